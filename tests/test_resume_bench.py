"""benchmarks/resume_vllm.py against the stand-in vLLM: lines cut by aborts every fraction of a second go on from what
they generated (the batch service's own resume code), each answered whole, nothing generated twice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent_support import FakeVllmProc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import resume_vllm  # noqa: E402


def test_cut_lines_are_answered_whole_and_nothing_is_generated_twice(tmp_path):
    server = FakeVllmProc("--token-s", "0.01", "--enable-sleep-mode")  # a line of 200 tokens takes 2 s at least
    try:
        assert resume_vllm.main(["--vllm-url", server.url, "--out", str(tmp_path), "--forms", "ids,chat",
                                 "--lines", "4", "--max-tokens", "200", "--valley-s", "0.3"]) == 0
    finally:
        server.proc.kill()
        server.proc.wait()
    got = json.loads((tmp_path / "resume.json").read_text())["forms"]
    for form in ("ids", "chat"):
        cut = got[form]["cut"]
        assert cut["cuts"] >= 1 and cut["restarted"] == 0 and cut["status"]["200 abort"] >= 4
        assert cut["full_length"] == cut["lines"] == 4 and cut["answers_completion_tokens"] == 4 * 200
        assert cut["generated_twice"] == 0 and got[form]["twice_of_in_flight"] == 0
        assert cut["answers_prompt_tokens"] == got[form]["A"]["answers_prompt_tokens"]  # the user's prompt, once
        answers = [json.loads(line) for line in (tmp_path / f"answers-{form}-cut.jsonl").read_text().splitlines()]
        assert sorted(a["line"] for a in answers) == [0, 1, 2, 3]
        assert all("token_ids" not in a["answer"]["choices"][0] for a in answers)  # asked for the resume alone


def test_a_form_that_does_not_exist_is_named(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        resume_vllm.main(["--vllm-url", "http://127.0.0.1:1", "--out", str(tmp_path), "--forms", "ids,jsonl"])
    assert exited.value.code == 2
    assert "--forms: jsonl is not one of ids, text, chat" in capsys.readouterr().err
