"""Running model-written code: the sandbox (``sandbox``) and a function's unit tests in two sandboxes
(``function_tests``, its child ``function_tests_child``)."""
