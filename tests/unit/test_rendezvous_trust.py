"""Rendezvous trust: DP_PLUGIN_JOB_SECRET signs what rank 0 publishes in
Horovod's rendezvous server (a real KVStoreServer here), the store server
listens on the advertised address only, and Gloo on loopback for one host."""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from dp_plugin.config import Config
from dp_plugin.engines import rendezvous
from dp_plugin.errors import CollectiveTimeoutError, ConfigError
from dp_plugin.launch import netif
from dp_plugin.launch.launchers import detect

SECRET = "0123456789abcdef0123"


def test_sign_and_verify() -> None:
    signed = rendezvous.sign(SECRET, "server|0", "10.0.0.1:1234")
    assert signed.startswith("10.0.0.1:1234#") and SECRET not in signed
    assert rendezvous.verify(SECRET, "server|0", signed) == ("10.0.0.1:1234", "")
    assert rendezvous.verify(None, "c", "10.0.0.1:1234") == ("10.0.0.1:1234", "")
    refusals = {
        "other secret": rendezvous.verify("x" * 20, "server|0", signed),
        "other init": rendezvous.verify(SECRET, "server|1", signed),
        "forged address": rendezvous.verify(SECRET, "server|0",
                                            signed.replace("10.0.0.1", "6.6.6.6")),
        "unsigned": rendezvous.verify(SECRET, "server|0", "6.6.6.6:1"),
        "no secret here": rendezvous.verify(None, "server|0", signed),
    }
    assert all(address is None and why for address, why in refusals.values()), refusals
    assert "not signed" in refusals["unsigned"][1]
    assert "this rank has no DP_PLUGIN_JOB_SECRET" in refusals["no secret here"][1]


@pytest.mark.parametrize("value", ["short", "has spaces in the middle", "é" * 20, "a\tb" * 8])
def test_a_weak_or_malformed_secret_is_refused_without_echoing_it(value: str) -> None:
    with pytest.raises(ConfigError, match="DP_PLUGIN_JOB_SECRET must be at least 16") as info:
        Config.from_env({"DP_PLUGIN_JOB_SECRET": value})
    assert value not in str(info.value)
    config = Config.from_env({"DP_PLUGIN_JOB_SECRET": SECRET})
    assert config.job_secret == SECRET and SECRET not in repr(config)


def test_the_secret_from_a_file_never_needs_a_command_line(tmp_path: Path) -> None:
    """horovodrun puts every exported variable on each worker's ``env K=V``
    command line (``ps`` shows it); DP_PLUGIN_JOB_SECRET_FILE passes a path."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    config = Config.from_env({"DP_PLUGIN_JOB_SECRET_FILE": str(path)})
    assert config.job_secret == SECRET and SECRET not in repr(config)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"has mode 644: other users may read.*chmod 600"):
        Config.from_env({"DP_PLUGIN_JOB_SECRET_FILE": str(path)})
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="both DP_PLUGIN_JOB_SECRET and"):
        Config.from_env({"DP_PLUGIN_JOB_SECRET_FILE": str(path), "DP_PLUGIN_JOB_SECRET": SECRET})
    with pytest.raises(ConfigError, match=r"DP_PLUGIN_JOB_SECRET_FILE=.*nope.* cannot be read"):
        Config.from_env({"DP_PLUGIN_JOB_SECRET_FILE": str(tmp_path / "nope")})
    path.write_text("short\n")
    with pytest.raises(ConfigError, match="DP_PLUGIN_JOB_SECRET must be at least 16") as info:
        Config.from_env({"DP_PLUGIN_JOB_SECRET_FILE": str(path)})
    assert "short" not in str(info.value)


def _topology(port: int, rank: int) -> object:
    return detect({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(rank),
                   "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)})


def test_workers_take_only_the_signed_address(kv_server: int) -> None:
    config = replace(Config(timeout_s=1.0), job_secret=SECRET)
    url = f"http://127.0.0.1:{kv_server}/{rendezvous.HOROVOD_SCOPE}/torch_store_7"
    forged = urllib.request.Request(url, data=b"6.6.6.6:1", method="PUT")
    urllib.request.urlopen(forged, timeout=5).close()  # an attacker writes first
    exchange = rendezvous._exchange_via_horovod
    with pytest.raises(CollectiveTimeoutError, match="refused: it is not signed"):
        exchange(_topology(kv_server, 1), config, 7, None)  # type: ignore[arg-type]
    exchange(_topology(kv_server, 0), config, 7, "127.0.0.1:4242")  # type: ignore[arg-type]
    assert exchange(_topology(kv_server, 1), config, 7, None) == "127.0.0.1:4242"  # type: ignore[arg-type]
    unsigned = replace(config, job_secret=None)
    with pytest.raises(CollectiveTimeoutError, match="this rank has no DP_PLUGIN_JOB_SECRET"):
        exchange(_topology(kv_server, 1), unsigned, 7, None)  # type: ignore[arg-type]


def test_the_store_server_listens_on_the_advertised_address_only() -> None:
    store = rendezvous._tcp_store("127.0.0.1", 0, detect({}), Config(timeout_s=5),
                                  is_master=True)
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections()
                 if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", store.port) in listening
    assert ("0.0.0.0", store.port) not in listening and ("::", store.port) not in listening
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass
    # A name (others may resolve it differently) or a foreign address: torch's default.
    assert rendezvous._listening_socket("localhost", 0) is None
    assert rendezvous._listening_socket("192.0.2.1", 0) is None  # TEST-NET-1, not ours


def test_gloo_listens_on_loopback_when_every_rank_is_on_this_host() -> None:
    env: dict[str, str] = {"MASTER_ADDR": "10.1.2.3"}
    name = netif.gloo_interface(env, single_host=True)
    assert name is not None and netif.interface_addresses()[name] == "127.0.0.1"
    assert env["GLOO_SOCKET_IFNAME"] == name
    mine = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert netif.gloo_interface(mine, single_host=True) is None
    assert mine["GLOO_SOCKET_IFNAME"] == "eth7"
