"""Tests of the SSH executor against a real sshd on loopback."""
