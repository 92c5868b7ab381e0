"""Fixtures of the multi-host tests: `netns_cluster`, a Ray cluster of a 0-CPU head and two 1-CPU worker hosts, each
host in its own network and mount namespace (tests/cluster/netns_cluster.py). Needs root with CAP_NET_ADMIN: without
it the fixture fails (it does not skip), so a CI job that lost the capability shows up red."""

import logging

import pytest
from netns_cluster import ClusterError, NetnsCluster

logger = logging.getLogger(__name__)


@pytest.fixture
def netns_cluster():
    cluster = NetnsCluster(n_hosts=2, cpus_per_host=1)
    try:
        cluster.start()
    except ClusterError as exc:
        pytest.fail(f"multi-host test cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
