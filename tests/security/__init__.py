"""The adversarial suite: a hostile job, a hostile member of the socket's group, and what a root
daemon must never do for them (issue 22). Root-only tests create throwaway users (tests/users.py)."""
