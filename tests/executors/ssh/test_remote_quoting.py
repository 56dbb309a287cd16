"""The remote command lines, checked against a local POSIX shell (no sshd needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from executors import remote

# Any text a path or argument may hold on a POSIX system (no NUL; newlines allowed in args).
words = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=30)


def sh(script: str, home: str = "/home/someone") -> str:
    env = {"PATH": os.environ["PATH"], "HOME": home}
    return subprocess.run(["sh", "-c", script], capture_output=True, env=env, check=True).stdout.decode()


@settings(max_examples=60, deadline=None)
@given(st.lists(words, min_size=1, max_size=6))
def test_every_argument_reaches_the_command_exactly_as_given(args: list[str]) -> None:
    out = sh(remote.join(["printf", "%s\\0", *args]))
    assert out.split("\0")[:-1] == args


@settings(max_examples=40, deadline=None)
@given(words.filter(lambda w: "\n" not in w))
def test_a_workdir_under_the_home_is_expanded_there_and_the_rest_is_taken_literally(rest: str) -> None:
    rest = rest.lstrip("/~") or "x"  # a leading ~ would make it a tilde expression (~user), a / absolute
    assert sh(f"printf %s {remote.path_expr('~/' + rest)}") == f"/home/someone/{rest}"
    assert sh(f"printf %s {remote.path_expr(rest)}") == f"/home/someone/{rest}"
    assert sh(f"printf %s {remote.path_expr('/abs/' + rest)}") == f"/abs/{rest}"


def test_a_tilde_user_workdir_is_expanded_by_the_remote_shell() -> None:
    assert sh(f"printf %s {remote.path_expr('~root/obd runs')}") == f"{Path('~root').expanduser()}/obd runs"
    assert sh(f"printf %s {remote.path_expr('~')}") == "/home/someone"


def test_the_start_command_hands_stdin_to_the_wrapper_beside_jobctl_and_returns_its_status(tmp_path: Path) -> None:
    tools = tmp_path / "tools $(date)"
    tools.mkdir()
    fake = tools / "supervisor.py"
    fake.write_text("import sys, os; print(sys.stdin.read(), os.getsid(0) == os.getpid(), sys.argv[1:]); sys.exit(3)")
    script = remote.start_command("python3", str(tools / "jobctl.py"), "/x/run $(date)")
    r = subprocess.run(["sh", "-c", script], input="SECRETS", capture_output=True, text=True, check=False)
    assert r.returncode == 3
    assert r.stdout.strip() == "SECRETS True ['start', '/x/run $(date)', '--secrets-stdin']"
    assert "SECRETS" not in script


def test_the_helper_command_replaces_the_shell_with_the_helper_and_quotes_its_paths(tmp_path: Path) -> None:
    fake = tmp_path / "a dir $(touch pwned)" / "jobserve.py"
    fake.parent.mkdir()
    fake.write_text("import os, sys; print(os.getpid(), sys.flags.no_site, sys.argv[1:])")
    script = remote.helper_command("python3", str(fake.with_name("jobctl.py"))) + "; echo the shell went on"
    out = subprocess.run(
        ["sh", "-c", f"echo $$; {script}"], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    shell_pid, line = out.splitlines()
    pid, no_site, argv = line.split(" ", 2)
    assert pid == shell_pid  # exec: the shell is gone, the helper took its place
    assert (no_site, argv) == ("1", "[]")  # jobserve.py, beside jobctl.py, with no subcommand
    assert not (tmp_path / "pwned").exists()


def test_uploads_leave_out_vcs_caches_and_virtual_environments(tmp_path: Path) -> None:
    for rel in ["a.py", "pkg/b.py", ".git/x", "pkg/__pycache__/c", "myenv/pyvenv.cfg", "node_modules/y"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    dirs, files, links = remote.walk_upload(tmp_path)
    assert dirs == [Path("pkg")]
    assert sorted(files) == [Path("a.py"), Path("pkg/b.py")]
    assert links == []
