"""cluster.toml parsing: the example, defaults, rank placement, and errors naming field and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbit.cluster.config import (
    ClusterConfigError,
    HostConfig,
    RankPlacement,
    SshConfig,
    load_cluster_config,
    parse_cluster_config,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "deploy" / "cluster.example.toml"

MINIMAL = """\
package = "pkg"

[[hosts]]
address = "gpu-a"
"""


def test_example_parses():
    config = load_cluster_config(EXAMPLE)
    assert config.package == EXAMPLE.parent / "packages" / "llama-3.1-70b-tp16"
    assert [h.address for h in config.hosts] == ["10.0.0.1", "10.0.0.2"]
    assert [h.nccl_interface for h in config.hosts] == ["eth1", "eth1"]
    assert config.frontend.address == "10.0.0.1"
    assert config.world_size == 16
    config.check_tp_size(16)


def test_defaults(monkeypatch):
    monkeypatch.setenv("HOME", "/home/tester")
    config = parse_cluster_config(MINIMAL, base_dir=Path("/srv"))
    host = config.hosts[0]
    assert config.package == Path("/srv/pkg")
    assert config.require_signature is False
    assert config.frontend.address == "127.0.0.1"
    assert config.frontend.port_range == (29500, 29600)
    assert host == HostConfig(address="gpu-a", known_hosts=Path("/home/tester/.ssh/known_hosts"))
    assert (host.ssh_port, host.gpus, host.workdir, host.python) == (
        22,
        (0,),
        "~/.orbit",
        "python3",
    )
    assert (host.device, host.nccl_interface, host.identity_file, dict(host.env)) == (
        "cuda",
        None,
        None,
        {},
    )


def test_every_host_field(monkeypatch):
    monkeypatch.setenv("HOME", "/home/tester")
    text = """\
package = "/abs/pkg"
require_signature = false

[frontend]
address = "10.0.0.9"
port_range = [40000, 40010]

[[hosts]]
address = "10.0.0.1"
ssh_port = 2222
user = "svc"
identity_file = "~/.ssh/orbit_ed25519"
known_hosts = "keys/known_hosts"
gpus = [2, 3]
workdir = "/data/orbit"
python = "/opt/venv/bin/python"
nccl_interface = "eth1"
device = "cpu"

[hosts.env]
NCCL_DEBUG = "WARN"
"""
    config = parse_cluster_config(text, base_dir=Path("/etc/orbit"))
    host = config.hosts[0]
    assert config.package == Path("/abs/pkg")
    assert config.frontend.port_range == (40000, 40010)
    assert host.identity_file == Path("/home/tester/.ssh/orbit_ed25519")
    assert host.known_hosts == Path("/etc/orbit/keys/known_hosts")
    assert (host.ssh_port, host.user, host.gpus, host.device) == (2222, "svc", (2, 3), "cpu")
    assert (host.workdir, host.python, host.nccl_interface) == (
        "/data/orbit",
        "/opt/venv/bin/python",
        "eth1",
    )
    assert dict(host.env) == {"NCCL_DEBUG": "WARN"}
    assert host.label == "10.0.0.1:2222"


def test_ranks_fill_hosts_in_file_order():
    text = (
        MINIMAL.replace('"gpu-a"', '"gpu-a"\ngpus = 2')
        + '[[hosts]]\naddress = "gpu-b"\ngpus = [3, 5]\n'
    )
    config = parse_cluster_config(text)
    assert config.rank_placements() == [
        RankPlacement(rank=0, host_index=0, local_gpu_index=0),
        RankPlacement(rank=1, host_index=0, local_gpu_index=1),
        RankPlacement(rank=2, host_index=1, local_gpu_index=3),
        RankPlacement(rank=3, host_index=1, local_gpu_index=5),
    ]
    assert config.ranks_on(1) == [2, 3]
    with pytest.raises(ClusterConfigError, match=r"place 4 ranks \(hosts\[0\]: 2, hosts\[1\]: 2\)"):
        config.check_tp_size(2)


TWO_HOSTS = """\
package = "pkg"

[frontend]
address = "10.0.0.1"

[[hosts]]
address = "10.0.0.1"
gpus = 2

[[hosts]]
address = "10.0.0.2"
{line12}
"""

# (the text of line 12 of TWO_HOSTS, the expected error after "cluster.toml:12: ")
HOST_ERRORS = [
    ("gpu = 2", "hosts[1].gpu is not a known setting; did you mean 'gpus'?"),
    ('ssh_port = "22"', "hosts[1].ssh_port must be an integer from 1 to 65535, got '22'."),
    ("ssh_port = 70000", "hosts[1].ssh_port must be an integer from 1 to 65535"),
    ("gpus = 0", "hosts[1].gpus must be a count >= 1 or a list of distinct GPU indices"),
    ("gpus = [1, 1]", "hosts[1].gpus must be a count >= 1 or a list of distinct GPU indices"),
    ("gpus = true", "hosts[1].gpus must be a count >= 1"),
    ('device = "tpu"', "hosts[1].device must be one of 'cuda', 'cpu', got 'tpu'."),
    ('workdir = "orbit"', 'hosts[1].workdir must be absolute or start with "~/"'),
    ('user = "a b"', "hosts[1].user must be a non-empty string without spaces"),
    ("env = { NCCL_DEBUG = 1 }", "hosts[1].env.NCCL_DEBUG must be a string, got 1; quote it."),
    ('env = { "1X" = "a" }', "hosts[1].env.1X is not a valid environment variable name."),
    ('address = "10.0.0.1"', "hosts[1].address repeats hosts[0]"),
]


@pytest.mark.parametrize(("line12", "message"), HOST_ERRORS)
def test_host_errors_name_field_and_line(line12, message):
    text = TWO_HOSTS.format(line12=line12)
    if line12.startswith("address"):  # replace the address rather than repeat the key
        text = text.replace('address = "10.0.0.2"\n', "\n")
    with pytest.raises(ClusterConfigError) as e:
        parse_cluster_config(text)
    assert str(e.value).startswith(f"cluster.toml:12: {message}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            MINIMAL.replace("package", "pakage"),
            "cluster.toml:1: pakage is not a known setting; did you mean 'package'?",
        ),
        (
            '[[hosts]]\naddress = "a"\n',
            'cluster.toml: package is required: package = "path/to/package".',
        ),
        ('package = "p"\n', "cluster.toml: hosts needs at least one [[hosts]] entry"),
        ('package = "p"\nhosts = []\n', "cluster.toml:2: hosts needs at least one [[hosts]] entry"),
        (
            'package = "p"\n\n[[hosts]]\nuser = "x"\n',
            "cluster.toml:3: hosts[0].address is required",
        ),
        (
            'package = "p"\n[frontnd]\n',
            "cluster.toml:2: frontnd is not a known setting; did you mean 'frontend'?",
        ),
        (
            MINIMAL + "[frontend]\nport_range = [30000, 29000]\n",
            "cluster.toml:6: frontend.port_range must be [start, end]",
        ),
        (
            MINIMAL + '[frontend]\nadress = "x"\n',
            "cluster.toml:6: frontend.adress is not a known setting; did you mean 'address'?",
        ),
        (
            "require_signature = true\n" + MINIMAL,
            "cluster.toml:1: require_signature = true needs trusted_keys",
        ),
        (
            'require_signature = "no"\n' + MINIMAL,
            "cluster.toml:1: require_signature must be true or false",
        ),
        (MINIMAL + "[hosts.env]\nX = 1\n", "cluster.toml:6: hosts[0].env.X must be a string"),
        (MINIMAL + 'address = "b"\n', "cluster.toml:5: not valid TOML: Cannot overwrite a value"),
        (
            'package = "p"\n[[hosts]]\naddress = "a" x\n',
            "cluster.toml:3: not valid TOML: Expected newline",
        ),
    ],
)
def test_other_errors_name_field_and_line(text, message):
    with pytest.raises(ClusterConfigError) as e:
        parse_cluster_config(text)
    assert str(e.value).startswith(message)


def test_unknown_key_without_a_close_match_lists_the_known_ones():
    with pytest.raises(ClusterConfigError) as e:
        parse_cluster_config(MINIMAL + "zzz = 1\n")
    assert str(e.value).startswith(
        "cluster.toml:5: hosts[0].zzz is not a known setting; known keys: address, ssh_port,"
    )


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot be read"):
        load_cluster_config(tmp_path / "cluster.toml")


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "prod.toml"
    path.write_text(MINIMAL + "gpus = -1\n")
    with pytest.raises(ClusterConfigError, match=rf"^{path}:5: hosts\[0\].gpus"):
        load_cluster_config(path)


def test_signature_settings_resolve_key_paths_against_the_file():
    text = 'require_signature = true\ntrusted_keys = ["keys/signer.pub", "/etc/orbit/b.pub"]\n'
    config = parse_cluster_config(text + MINIMAL, base_dir=Path("/srv"))
    assert config.require_signature is True
    assert config.trusted_keys == (Path("/srv/keys/signer.pub"), Path("/etc/orbit/b.pub"))


def test_ssh_timeouts_have_defaults_and_can_be_set():
    assert parse_cluster_config(MINIMAL).ssh == SshConfig(5.0, 3, 60.0)
    assert SshConfig().silence_limit_s == 20.0  # a silent host is given up after 20 s
    text = "[ssh]\nkeepalive_interval_s = 2.5\nkeepalive_count_max = 5\nstall_timeout_s = 300\n"
    config = parse_cluster_config(MINIMAL + text)
    assert config.ssh == SshConfig(2.5, 5, 300.0)
    assert config.ssh.silence_limit_s == 15.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("stall_timeout = 60", "ssh.stall_timeout is not a known setting; did you mean"),
        ("stall_timeout_s = 0", "ssh.stall_timeout_s must be a number of seconds > 0, got 0."),
        ('keepalive_interval_s = "5"', "ssh.keepalive_interval_s must be a number of seconds"),
        ("keepalive_count_max = 0", "ssh.keepalive_count_max must be an integer >= 1, got 0."),
    ],
)
def test_ssh_errors_name_field_and_line(line, message):
    with pytest.raises(ClusterConfigError) as e:
        parse_cluster_config(MINIMAL + f"\n[ssh]\n{line}\n")
    assert str(e.value).startswith(f"cluster.toml:7: {message}")
