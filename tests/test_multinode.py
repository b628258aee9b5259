"""A 2-"node" job on one machine: two `deepspeed --no_ssh` launchers (node ranks 0 and 1, one CPU rank each, a
hostfile naming 127.0.0.1 and localhost) train the tiny recipe; its loss curve must equal that of one launcher
starting both ranks."""

from __future__ import annotations

import pytest
from helpers.launches import STEPS, partition_all_config, single_launcher_run, step_records, two_node_run

pytestmark = pytest.mark.slow


def test_two_node_launch_reproduces_the_single_launcher_loss_curve(tmp_path_factory, tmp_path):
    two_nodes = two_node_run(tmp_path_factory)
    one_launcher = single_launcher_run(tmp_path / "run", partition_all_config(tmp_path), ranks=2)
    nodes, single = step_records(two_nodes), step_records(one_launcher)
    assert sorted(nodes) == sorted(single) == list(range(1, STEPS + 1))
    for step in nodes:
        for key in ("loss", "ce", "ntl", "grad_norm", "tokens"):
            assert nodes[step][key] == single[step][key], f"step {step}: {key} differs between the launches"
    logs = {path.name: path.read_text() for path in two_nodes.parent.glob("node*.log")}
    for rank in (0, 1):
        assert f"nnodes=2, num_local_procs=1, node_rank={rank}" in logs[f"node{rank}.log"]
    assert "dist_world_size=2" in logs["node1.log"]
