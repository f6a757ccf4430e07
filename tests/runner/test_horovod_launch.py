"""Horovod's launch vocabulary: host lists (-H, --hostfile), horovod.run()'s keyword names and
the leading interpreter word, read and checked before any Spark job. Fast: no Spark."""
import os
import sys

import pytest

from sparkring import ConfigurationError
from sparkring.__main__ import _without_interpreter
from sparkring.runner.driver.horovod_launch import (
    HostSlots,
    parse_hosts,
    ranks_from_hosts,
    read_hostfile,
    translate_run_keywords,
)


def test_a_host_list_gives_each_host_its_slots():
    assert parse_hosts("localhost:4") == [HostSlots("localhost", 4)]
    assert parse_hosts("a:2, b") == [HostSlots("a", 2), HostSlots("b", 1)]
    with pytest.raises(ConfigurationError, match="'a:x' is not host:slots"):
        parse_hosts("a:x")


def test_a_hostfile_reads_horovods_slots_lines(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two workers\nworker-1 slots=4\nworker-2:2\n\n")
    assert read_hostfile(str(path)) == [HostSlots("worker-1", 4), HostSlots("worker-2", 2)]
    with pytest.raises(ConfigurationError, match="does not exist"):
        read_hostfile(str(tmp_path / "missing"))


def test_one_local_host_runs_its_slots_and_what_cannot_match_the_session_is_refused():
    local = [HostSlots("localhost", 4)]
    assert ranks_from_hosts(local, None, local_session=True) == 4
    assert ranks_from_hosts(local, 2, local_session=True) == 2
    with pytest.raises(ConfigurationError, match="-np 6 is more than the 4 slot"):
        ranks_from_hosts(local, 6, local_session=True)
    with pytest.raises(ConfigurationError, match="names 2 hosts .* but Spark runs in local mode"):
        ranks_from_hosts([HostSlots("a", 2), HostSlots("b", 2)], None, local_session=True)
    assert ranks_from_hosts([HostSlots("a", 2), HostSlots("b", 2)], None, local_session=False, slots=4) == 4
    with pytest.raises(ConfigurationError, match="asks for 4 ranks but this Spark session has 3 task slot"):
        ranks_from_hosts([HostSlots("a", 2), HostSlots("b", 2)], None, local_session=False, slots=3)


def test_horovod_run_keywords_become_sparkrings():
    ours = dict(num_proc=None, min_proc=None, backend="auto", verbose=1)
    assert translate_run_keywords({"np": 2, "use_gloo": True, "use_mpi": False, "hosts": None}, ours) == \
        dict(num_proc=2, min_proc=None, backend="gloo", verbose=1)
    assert translate_run_keywords({"np": 2, "min_np": 1, "max_np": 3, "verbose": True}, ours) == \
        dict(num_proc=3, min_proc=1, backend="auto", verbose=2)
    assert translate_run_keywords({"np": 2, "max_np": 4}, ours)["min_proc"] == 2
    with pytest.raises(ConfigurationError, match="use_gloo=True and use_mpi=True"):
        translate_run_keywords({"use_gloo": True, "use_mpi": True}, ours)
    with pytest.raises(ConfigurationError, match=r"np= \(Horovod's name\) and num_proc= disagree"):
        translate_run_keywords({"np": 2}, {**ours, "num_proc": 3})
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['slots_per_host'\]"):
        translate_run_keywords({"slots_per_host": 2}, ours)


@pytest.mark.parametrize("word", ["python", "python3", sys.executable, os.path.basename(sys.executable)])
def test_a_leading_interpreter_word_is_dropped(word):
    assert _without_interpreter(word, ["train.py", "--lr", "0.1"]) == ("train.py", ["--lr", "0.1"])
    assert _without_interpreter("train.py", ["--lr"]) == ("train.py", ["--lr"])
