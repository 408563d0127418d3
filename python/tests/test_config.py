"""``cohort.GroupConfig`` and ``cohort.Group``'s two ways in: a config object, or the config's
arguments. Bad input raises before anything is contacted (nothing listens on port 1)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

import cohort

NOWHERE = "http://127.0.0.1:1"


def test_a_bad_value_in_the_config_is_refused_before_joining():
    for change, field in [
        (dict(no_progress_timeout=-1.0), "no_progress_timeout"),
        (dict(listen="nonsense"), "listen"),
        (dict(algorithm="quantum"), "quantum"),
        (dict(segment_bytes=0), "segment_bytes"),
        (dict(segment_bytes="many"), "GroupConfig.segment_bytes"),
        (dict(heartbeat_relay="sometimes"), "GroupConfig.heartbeat_relay"),
        (dict(relay_dir="relative/dir"), "relay_dir: relay directory relative/dir is not an absolute path"),
        (dict(relay_dir=pathlib.Path("/" + "d" * 60)), "relay_dir: relay directory /d+ is 61 bytes long"),
        (dict(transport="carrier-pigeon"), '"auto", "tcp", "shm" or "rdma"'),
        (dict(coordinator=[]), "coordinator"),
        (dict(job=" "), "job"),
    ]:
        config = dataclasses.replace(cohort.GroupConfig("j", NOWHERE, "w0", handle_sigterm=False), **change)
        with pytest.raises(cohort.InvalidArgumentError, match=field):
            cohort.Group(config)


def test_rdma_is_a_choice_with_a_clear_error_where_it_cannot_run():
    # The package is built without the `rdma` feature here (or, with it, finds no device).
    config = cohort.GroupConfig("j", NOWHERE, "w0", transport="rdma", handle_sigterm=False)
    with pytest.raises(cohort.InvalidArgumentError, match="transport rdma") as raised:
        cohort.Group(config)
    message = str(raised.value)
    assert "--features rdma" in message or "no RDMA device" in message, message


def test_a_config_takes_no_other_arguments_and_unknown_options_are_type_errors():
    config = cohort.GroupConfig("j", NOWHERE, "w0", handle_sigterm=False)
    with pytest.raises(cohort.InvalidArgumentError, match="no other arguments"):
        cohort.Group(config, NOWHERE)
    with pytest.raises(cohort.InvalidArgumentError, match="no other arguments"):
        cohort.Group(config, no_progress_timeout=1.0)
    with pytest.raises(TypeError, match="coordinator"):
        cohort.Group("j")
    with pytest.raises(TypeError, match="no_such_option"):
        cohort.Group("j", NOWHERE, no_such_option=1)


def test_a_group_joins_with_a_config_and_keeps_it(coordinator_factory):
    coord = coordinator_factory(1)
    config = cohort.GroupConfig("config-job", coord.endpoint, "w0", transport="tcp", handle_sigterm=False)
    with cohort.Group(config) as group:
        assert group.config is config
        assert (group.job, group.worker_id) == ("config-job", "w0")
        comm = group.next_generation()
        assert (comm.size, comm.rank, comm.transport) == (1, 0, "tcp")
    # The keyword form builds the same config.
    with cohort.Group("config-job-2", coord.endpoint, "w1", transport="tcp", handle_sigterm=False) as group:
        assert group.config == dataclasses.replace(config, job="config-job-2", worker_id="w1")
