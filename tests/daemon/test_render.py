"""What `obd train list` and `obd train status` print for runs whose strings are hostile.

Names, messages, commands, targets and reasons are written by users and jobs. Printed raw, an
escape sequence in a run name clears the screen or retitles the terminal, and a newline fakes
a row of the table. Here every such string reaches the text only as an escape a person can read.
"""

from __future__ import annotations

import time
import unicodedata
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from daemon.cli import render
from daemon.service.models import RunRecord, RunState, Snapshot

CLEAR_SCREEN = "\x1b[2J\x1b[H"
RETITLE = "\x1b]0;owned\x07"
FAKE_ROW = "\n20990101-000000-fake00  fake  succeeded"
BIDI_OVERRIDE = "\u202e"  # shows the rest of the line right to left: `txt.exe` reads `exe.txt`
HOSTILE = [
    CLEAR_SCREEN,
    RETITLE,
    FAKE_ROW,
    "back\bspace",
    "carriage\rreturn",
    "tab\there",
    "\x9b31m",
    "\x7f",
    "line\u2028separator",
    BIDI_OVERRIDE + "exe.txt",
    "lone \ud800 surrogate",
]


def unsafe(text: str) -> list[str]:
    """The characters of `text` that a terminal would act on rather than show (line breaks aside)."""
    return [
        char
        for char in text
        if char != "\n"
        and (
            unicodedata.category(char) in {"Cc", "Cs", "Zl", "Zp"}
            or char in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
        )
    ]


def hostile_record(text: str, run_id: str = "20990101-000000-abcdef") -> dict[str, Any]:
    """A run whose every user- or job-written string carries `text`."""
    record = RunRecord(
        id=run_id,
        name=f"name{text}",
        target=f"target{text}",
        remote_dir=f"/runs/{text}",
        command=["python", f"train{text}.py", f"--note={text}"],
        message=f"message{text}",
        resumed_from=f"run{text}",
        resume_checkpoint=f"output/checkpoint-{text}",
        exit_code=3,
        snapshot=Snapshot(checkpoint=f"output/checkpoint-{text}", step=5, reason=f"reason{text}", time=time.time()),
        target_info={"pod_id": f"pod{text}", "gpu_type": f"gpu{text}", "phase": f"phase{text}"},
    )
    record.transition(RunState.running, f"started{text}")
    record.note(f"note{text}")
    public = record.public()
    public["pod"] = {"state": f"RUNNING{text}", "error": f"api{text}", "cost_per_hr": 1.5}
    return public


def test_a_run_name_with_escape_sequences_and_newlines_is_listed_as_escapes_on_its_own_row():
    runs = [hostile_record(text, f"20990101-000000-{i:06d}") for i, text in enumerate(HOSTILE)]
    out = render.table(runs)
    assert unsafe(out) == []
    lines = out.split("\n")
    assert len(lines) == 1 + len(runs)  # the header, then one row per run: no row was faked
    assert lines[1].startswith("20990101-000000-000000  name\\x1b[2J\\x1b[H")
    assert "name\\x1b]0;owned\\x07" in out
    assert "name\\n20990101-000" in out
    assert out.encode("utf-8")  # a lone surrogate would make printing it raise


def test_the_table_stays_aligned_when_names_are_escaped():
    runs = [hostile_record(text, f"20990101-000000-{i:06d}") for i, text in enumerate(HOSTILE)]
    runs.append(hostile_record("", "20990101-000000-plain0"))
    lines = render.table(runs).split("\n")
    state_column = lines[0].index("STATE")
    assert {line[state_column:].split()[0] for line in lines[1:]} == {"running"}


def test_every_string_of_a_hostile_run_is_shown_escaped_in_its_status():
    for text in HOSTILE:
        record = hostile_record(text)
        out = render.status(record)
        assert unsafe(out) == [], text
        plain = render.status(hostile_record(""))
        # The same lines as a run with harmless strings: nothing added a line or took one away.
        assert len(out.split("\n")) == len(plain.split("\n")), text
    out = render.status(hostile_record(CLEAR_SCREEN))
    for shown in (
        "run       20990101-000000-abcdef  (name\\x1b[2J\\x1b[H)",
        "message   started\\x1b[2J",
        "target    target\\x1b[2J",
        "command   python train\\x1b[2J\\x1b[H.py --note=\\x1b[2J",
        "(reason\\x1b[2J\\x1b[H)",
        "from run\\x1b[2J",
        "pod       pod\\x1b[2J",
        "started\\x1b[2J",
        "note\\x1b[2J",
        "(API: api\\x1b[2J",
    ):
        assert shown in out, shown


def test_a_stop_reason_waiting_for_its_snapshot_is_escaped_too():
    record = hostile_record(RETITLE)
    record.update(snapshot=None, state="running")
    record["stop"]["requested_at"] = time.time()
    record["stop"]["reason"] = f"why{RETITLE}"
    out = render.status(record)
    assert "stop      requested (why\\x1b]0;owned\\x07)" in out
    assert unsafe(out) == []


def test_an_unreadable_record_with_control_characters_in_its_error_is_listed_escaped():
    out = render.table([{"id": "20990101-000000-bad000", "state": "unreadable", "message": f"bad byte{FAKE_ROW}"}])
    assert len(out.split("\n")) == 2
    assert "bad byte\\n20990101" in out


def test_names_in_any_script_with_accents_emoji_and_joiners_are_printed_as_they_are():
    names = ["café-déjà-vu", "学习率扫描", "تجربة", "שלום", "👩‍🔬 run", "naïve e\u0301", "a\u00a0b", "Ünïcödé"]
    runs = [hostile_record("", f"20990101-000000-{i:06d}") | {"name": name} for i, name in enumerate(names)]
    out = render.table(runs)
    for name in names:
        assert name[:20] in out
    assert f"({names[4]})" in render.status(runs[4])


def test_printable_escapes_like_repr_and_leaves_plain_text_alone():
    assert render.printable("a\x1b[31mb\nc\td\r") == "a\\x1b[31mb\\nc\\td\\r"
    assert render.printable("\x9b\x7f\u2028\u202e") == "\\x9b\\x7f\\u2028\\u202e"
    assert render.printable("plain text, 100%") == "plain text, 100%"
    assert render.printable(None) == "None"


def test_printable_lines_keeps_the_line_breaks_and_escapes_the_rest():
    assert render.printable_lines("top kernels\n  gemm\x1b[2J  50%\n") == "top kernels\n  gemm\\x1b[2J  50%\n"


@given(st.text(st.characters(exclude_categories=[])), st.text(), st.lists(st.text(), max_size=4))
def test_no_name_message_or_command_puts_a_control_character_or_a_line_into_the_output(name, message, command):
    record = hostile_record("")
    record.update(name=name, message=message, command=command)
    assert unsafe(render.table([record])) == []
    assert len(render.table([record]).split("\n")) == 2
    out = render.status(record)
    assert unsafe(out) == []
    assert len(out.split("\n")) == len(render.status(hostile_record("")).split("\n"))


def test_the_status_of_a_slurm_run_names_its_job_state_nodes_and_slurms_reason():
    record = RunRecord(id="20990101-000000-abcdef", state=RunState.running, target="cluster", command=["train"])
    data = record.model_dump(mode="json") | {
        "slurm": {"job_id": "4242", "state": "PENDING", "reason": "Resources", "nodes": "(null)"}
    }
    assert "slurm     job 4242 PENDING (Resources)" in render.status(data)
    data["slurm"] = {"job_id": "4242", "state": "RUNNING", "reason": "None", "nodes": "n[1-2]"}
    assert "slurm     job 4242 RUNNING on n[1-2]\n" in render.status(data)
    data["slurm"] = {"job_id": "4242", "state": "TIMEOUT\x1b[2J", "nodes": "n1", "exit_code": "0:15"}
    assert "slurm     job 4242 TIMEOUT\\x1b[2J on n1 exit 0:15" in render.status(data)
    assert "slurm" not in render.status(record.model_dump(mode="json"))
