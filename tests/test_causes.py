"""Failures reduced to causes that alike failures share, for `status` and `retry-failed --cause`."""

from __future__ import annotations

from producer.console.causes import Failure, cause_of, failure_line, group_by_cause, matches

TRACEBACK = """Traceback (most recent call last):
  File "worker/generation.py", line 60, in _generate
    raise PermanentError(message)
worker.sglang.PermanentError: http://gpu-1:30000: HTTP 400: input of 80 tokens is too long
"""


def test_the_failure_line_of_a_traceback_is_its_last_unindented_line():
    assert failure_line(TRACEBACK).startswith("worker.sglang.PermanentError: ")
    assert failure_line("Refused: bad job\nmore") == "Refused: bad job"
    assert failure_line("  \n") == ""


def test_causes_drop_module_paths_urls_and_numbers_but_keep_status_codes():
    line = failure_line(TRACEBACK)
    assert cause_of(line) == "PermanentError: HTTP 400: input of N tokens is too long"
    other = line.replace("gpu-1", "gpu-2").replace("80", "93")
    assert cause_of(other) == cause_of(line)
    assert cause_of("x" * 300).endswith("...") and len(cause_of("x" * 300)) == 160


def test_failures_group_by_cause_most_frequent_first_and_match_case_aside():
    failures = [
        Failure(f"j{n}", "p", f"E: HTTP 503 in {n} tries", cause_of(f"E: HTTP 503 in {n} tries")) for n in range(3)
    ]
    failures.append(Failure("k", "q", "Refused: unreadable", "Refused: unreadable"))
    groups = group_by_cause(failures)
    assert [(cause, len(group)) for cause, group in groups] == [
        ("E: HTTP 503 in N tries", 3),
        ("Refused: unreadable", 1),
    ]
    assert matches(failures[0], "http 503") and matches(failures[0], None) and not matches(failures[0], "400")
