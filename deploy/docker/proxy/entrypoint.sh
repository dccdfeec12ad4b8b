#!/bin/sh
# Starts nginx (nginx.conf) with what only the running container knows: the login of
# RLVR_PROXY_USER (default rlvr) and RLVR_PROXY_PASSWORD, hashed here (SHA-512 crypt) so nginx never
# holds the password; the DNS server of the container's network (Docker's or podman's); and the TLS
# certificate, /etc/rlvr-proxy/tls/tls.crt and tls.key, made self-signed on the first start if absent.
set -eu
: "${RLVR_PROXY_PASSWORD:?is not set: the password of the proxy login (deploy/README.md, Security)}"
run=/run/rlvr-proxy
tls=/etc/rlvr-proxy/tls
mkdir -p "$run" "$tls"

hash="$(printf '%s\n' "$RLVR_PROXY_PASSWORD" | openssl passwd -6 -stdin)"
(umask 027 && printf '%s:%s\n' "${RLVR_PROXY_USER:-rlvr}" "$hash" >"$run/htpasswd")
chgrp www-data "$run/htpasswd"  # nginx's workers read it per request
unset RLVR_PROXY_PASSWORD

nameserver="$(awk '$1 == "nameserver" { print $2; exit }' /etc/resolv.conf)"
case "$nameserver" in *:*) nameserver="[$nameserver]" ;; esac
echo "resolver $nameserver valid=10s;" >"$run/resolver.conf"

if [ ! -s "$tls/tls.crt" ] || [ ! -s "$tls/tls.key" ]; then
  (umask 077 && openssl req -x509 -newkey rsa:3072 -nodes -days 825 -subj "/CN=rlvr-ops" \
    -keyout "$tls/tls.key" -out "$tls/tls.crt" 2>/dev/null)
  echo "entrypoint.sh: made a self-signed certificate, $(openssl x509 -in "$tls/tls.crt" -noout -fingerprint -sha256)" >&2
fi

exec nginx -c /etc/nginx/rlvr-proxy.conf -e stderr -g "daemon off;"
