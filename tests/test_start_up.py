"""The start-up's waits say how far they have got (stages/start_up.py), on the shared Ray."""

from __future__ import annotations

import time

from dhp.stages.start_up import wait_all


def test_a_long_wait_prints_how_many_are_ready_and_a_timeout_returns_those(ray_session, capsys):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def ready_after(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    refs = [ready_after.remote(0.0), ready_after.remote(2.0)]
    ray.get(refs[0])
    assert wait_all(refs, "pool: {ready} of {total} ranks built after {seconds:.1f} s", every_s=0.5) == refs
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("pool: 1 of 2 ranks built after ") for line in lines), lines
    seconds = [float(line.split()[-2]) for line in lines]
    assert seconds == sorted(seconds) and seconds[0] >= 0.5

    slow = ready_after.remote(30.0)
    begun = time.monotonic()
    assert wait_all([slow], "{ready} of {total} after {seconds:.0f} s", timeout_s=1.0, every_s=0.4) == []
    assert time.monotonic() - begun < 10
    lines = capsys.readouterr().out.splitlines()
    assert 1 <= len(lines) <= 3 and all(line.startswith("0 of 1 after ") for line in lines), lines
    ray.cancel(slow, force=True)


def test_nothing_to_wait_for_is_ready_at_once(ray_session, capsys):
    assert wait_all([], "{ready} of {total}") == []
    assert capsys.readouterr().out == ""
