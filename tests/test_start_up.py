"""The start-up's waits say how far they have got (stages/start_up.py), on the shared Ray."""

from __future__ import annotations

import time

from dhp.stages.start_up import wait_all


def test_a_long_wait_prints_how_many_are_ready_and_a_timeout_returns_those(ray_session, capsys):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Sleeper:
        def ready(self) -> bool:
            return True

        def sleep(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    sleeper = Sleeper.remote()
    try:
        ray.get(sleeper.ready.remote())  # its process started: the waits below are the calls' own
        refs = [ray.put(0.0), sleeper.sleep.remote(2.0)]
        assert wait_all(refs, "pool: {ready} of {total} ranks built after {seconds:.1f} s", every_s=0.5) == refs
        lines = capsys.readouterr().out.splitlines()
        assert lines and all(line.startswith("pool: 1 of 2 ranks built after ") for line in lines), lines
        seconds = [float(line.split()[-2]) for line in lines]
        assert seconds == sorted(seconds) and seconds[0] >= 0.5

        slow = sleeper.sleep.remote(30.0)
        begun = time.monotonic()
        assert wait_all([slow], "{ready} of {total} after {seconds:.0f} s", timeout_s=1.0, every_s=0.4) == []
        assert time.monotonic() - begun < 10
        lines = capsys.readouterr().out.splitlines()
        assert 1 <= len(lines) <= 3 and all(line.startswith("0 of 1 after ") for line in lines), lines
    finally:
        ray.kill(sleeper)


def test_nothing_to_wait_for_is_ready_at_once(ray_session, capsys):
    assert wait_all([], "{ready} of {total}") == []
    assert capsys.readouterr().out == ""
