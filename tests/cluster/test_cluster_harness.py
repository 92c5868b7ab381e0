"""The multi-host harness itself (tests/cluster/netns_cluster.py): 3 alive nodes (a 0-CPU head, two 1-CPU worker
hosts), a job's tasks run on both worker hosts, and each host's ~/.cache is its own.

    .venv/bin/python -m pytest tests/cluster/test_cluster_harness.py -m slow      # as root (CAP_NET_ADMIN)
"""

import json

import pytest
from netns_cluster import job_logs


@pytest.mark.slow
def test_harness_hosts_are_separate(netns_cluster):
    cluster = netns_cluster
    nodes = cluster.alive_nodes()
    assert sorted(n["node_ip"] for n in nodes) == sorted([cluster.head_ip, cluster.host_ip(0), cluster.host_ip(1)])
    head = next(n for n in nodes if n["node_ip"] == cluster.head_ip)
    assert head["resources_total"].get("CPU", 0) == 0

    done = cluster.submit_script("tests/cluster/probe_job.py")
    assert done.returncode == 0, job_logs(cluster, done)
    line = next(x for x in done.stdout.splitlines() if x.startswith("PROBE "))
    report = json.loads(line[len("PROBE ") :])
    assert report["driver_ip"] == cluster.head_ip
    ips = {t["ip"] for t in report["tasks"]}
    assert ips == {cluster.host_ip(0), cluster.host_ip(1)}, report
    for task in report["tasks"]:  # a host sees only the marker its own task wrote
        assert task["seen"] == [f"probe_marker_{task['i']}"], report

    # and a file written on one host's ~/.cache is not on the other's, nor on the machine's
    wrote = cluster.host_run(0, "echo x > ~/.cache/only_on_host0 && ls ~/.cache")
    assert wrote.returncode == 0 and "only_on_host0" in wrote.stdout, wrote.stderr
    assert cluster.host_run(1, "test -e ~/.cache/only_on_host0").returncode == 1
    # the shared directory is seen by both
    assert cluster.host_run(0, f"echo shared > {cluster.shared}/s").returncode == 0
    assert cluster.host_run(1, f"cat {cluster.shared}/s").stdout.strip() == "shared"
