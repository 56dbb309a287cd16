"""A made-up kind of target, `kind = "toy"`, in a package of its own as a new kind would be
(tests/executors/test_kinds.py registers it for one test, then takes it away)."""
