"""Runs ON a cluster host, with the host's `python` and the ranks' `env`: prints one JSON line
describing the host, then exits. orbit/cluster/fingerprint.py sends this file's source over SSH
(`python -c SOURCE ARGS_JSON`) and parses the line.

Standard library only, plus torch and orbit when the host can import them (their absence is
reported, not an error). Every probe is bounded in time and never raises: a field that cannot be
read is reported as null with the reason under "errors". The output is only displayed and
compared; nothing in it is executed or trusted.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

COMMAND_TIMEOUT_S = 10.0
SMI_QUERY = "index,name,memory.total,memory.free,driver_version"


def main() -> None:
    args = json.loads(sys.argv[1])
    errors = {}
    out = {"python": platform.python_version(), "hostname": socket.gethostname()}
    for name, probe in (
        ("orbit", orbit_info),
        ("torch", torch_info),
        ("nvidia_smi", nvidia_smi_info),
        ("interfaces", interfaces_info),
    ):
        try:
            out.update(probe())
        except Exception as e:  # noqa: BLE001 - a failed probe leaves its fields out, with why
            errors[name] = f"{type(e).__name__}: {e}"
    out.update(workdir_info(args["workdir"], args["package_files"]))
    out["routes"] = [route_to(peer) for peer in args["peers"]]
    out["errors"] = errors
    out["time"] = time.time()  # last, so the caller's receipt time is close to it
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # torch's interpreter teardown can take a while; the caller is waiting


def orbit_info() -> dict:
    import orbit

    return {"orbit": getattr(orbit, "__version__", "unknown"), "orbit_code": code_digest()}


# Orbit's code as it runs on a host: its packages' Python and protobuf sources. __version__
# alone changes only with releases, while hosts on different commits disagree on the wire.
CODE_PACKAGES = ("orbit", "ranks", "runtime", "prepare", "proto")
CODE_SUFFIXES = (".py", ".proto")


def code_digest(search_path: list | None = None) -> str:
    """SHA-256 over the sorted relative paths, sizes and bytes of the CODE_SUFFIXES files of
    CODE_PACKAGES where this interpreter imports them from (or under search_path), without
    importing them. A package that cannot be found counts by its name alone."""
    import hashlib
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    files = []
    for name in CODE_PACKAGES:
        spec = PathFinder.find_spec(name, search_path) if search_path else find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            files += package_files(name, root)
    digest = hashlib.sha256(" ".join(CODE_PACKAGES).encode())
    for rel, path in sorted(files):
        with open(path, "rb") as f:
            data = f.read()
        digest.update(f"\0{rel}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def package_files(name: str, root: str) -> list:
    """(name/relative/path, absolute path) of each source file under root."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for file in names:
            if file.endswith(CODE_SUFFIXES):
                rel = os.path.relpath(os.path.join(folder, file), root).replace(os.sep, "/")
                found.append((f"{name}/{rel}", os.path.join(folder, file)))
    return found


def torch_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "nccl": None}
    info["cuda_available"] = bool(torch.cuda.is_available())
    # device_count() asks the driver without creating a context on any GPU.
    info["gpu_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    if info["cuda_available"]:
        info["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    return info


def nvidia_smi_info() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"gpus": []}
    query = ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"]
    done = subprocess.run(
        query, check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    gpus, drivers = [], []
    for line in done.stdout.splitlines():
        index, name, total, free, driver = [p.strip() for p in line.split(",")]
        gpus.append(
            {"index": int(index), "name": name, "total_mib": int(total), "free_mib": int(free)}
        )
        drivers.append(driver)
    return {"gpus": gpus, "driver": drivers[0] if drivers else None}


def workdir_info(workdir: str, package_files: list) -> dict:
    root = os.path.expanduser(workdir)
    existing = root
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # the workdir may not exist yet: its parent's disk
    missing = [f for f in package_files if not os.path.exists(os.path.join(root, f))]
    return {
        "workdir": os.path.abspath(root),
        "disk_free_bytes": shutil.disk_usage(existing).free,
        "package_missing": missing,
    }


def interfaces_info() -> dict:
    """Each interface: name, loopback, up, kind (bridge/tun/None) and addresses."""
    found = {}
    for _, name in socket.if_nameindex():
        found[name] = {"name": name, "kind": link_kind(name), "addresses": []}
        found[name].update(link_flags(name))
    if not shutil.which("ip"):  # no iproute2: the IPv4 address of each, from the kernel
        for name, entry in found.items():
            entry["addresses"] = ipv4_of(name)
        return {"interfaces": list(found.values())}
    done = subprocess.run(
        ["ip", "-j", "addr"], check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    for link in json.loads(done.stdout or "[]"):
        entry = found.get(link.get("ifname"))
        if entry is not None:
            entry["addresses"] = [a["local"] for a in link.get("addr_info", []) if "local" in a]
    return {"interfaces": list(found.values())}


def ipv4_of(name: str) -> list:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            request = struct.pack("256s", name.encode()[:15])
            answer = fcntl.ioctl(s.fileno(), 0x8915, request)  # SIOCGIFADDR
        except OSError:
            return []  # no IPv4 address
    return [socket.inet_ntoa(answer[20:24])]


def link_kind(name: str) -> str | None:
    base = f"/sys/class/net/{name}"
    if os.path.isdir(f"{base}/bridge"):
        return "bridge"
    if os.path.exists(f"{base}/tun_flags"):
        return "tun"
    return None


def link_flags(name: str) -> dict:
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            flags = int(f.read().strip(), 16)
    except (OSError, ValueError):
        return {"loopback": name == "lo", "up": True}
    return {"loopback": bool(flags & 0x8), "up": bool(flags & 0x1)}  # IFF_LOOPBACK, IFF_UP


def route_to(peer: str) -> dict:
    """The source address this host uses to reach `peer`: a UDP connect() only consults the
    routing table, no packet is sent."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return {"peer": peer, "address": sockaddr[0], "source": s.getsockname()[0]}
    except OSError as e:
        return {"peer": peer, "error": str(e)}


if __name__ == "__main__":
    main()
