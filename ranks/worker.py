"""The rank's life: connect, join the TP group, load, allocate KV (capture graphs on CUDA),
check collectives, report ready, execute steps until told to stop. Each start-up phase is
reported as it begins (ranks/startup.py). Any failure is reported to the frontend as a Failure
message before exiting non-zero, since a TP group cannot go on without one of its members."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
import zmq

from proto import wire_pb2
from ranks.collectives import CollectivesCheck, check_collectives, join_check
from ranks.config import RankConfig
from ranks.drafting import Drafter
from ranks.startup import Phases, Watchdog
from ranks.steps import Launched, StepExecutor
from runtime.curve import ClientKeys, secure_client
from runtime.grammar import GrammarMasks
from runtime.kv_cache import KVCache, KVCacheShape, page_dtype
from runtime.layers import TPGroup
from runtime.model import build_model
from runtime.package import Package, check_draft, open_package
from runtime.runner import ReferenceRunner
from runtime.sampling import sample
from runtime.signing import load_public_key

log = logging.getLogger("orbit.rank")


class Rank:
    def __init__(self, cfg: RankConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"rank-{cfg.rank}".encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        if cfg.curve_dir:
            secure_client(self.sock, ClientKeys.load(Path(cfg.curve_dir), cfg.rank))
        self.sock.connect(cfg.frontend)
        self.steps: StepExecutor | None = None
        self.last_step = 0
        self.parent_pid = os.getppid()
        self.hello: wire_pb2.Hello | None = None
        self.ready: wire_pb2.Ready | None = None
        self.closing = threading.Event()
        self.phases = Phases(cfg.rank, lambda msg: self.sock.send(msg.SerializeToString()))
        self.watchdog = Watchdog(
            self.ctx, cfg.frontend, cfg.curve_dir, cfg.rank, cfg.join_timeout_s
        )

    def send(self, **kind) -> None:
        self.sock.send(wire_pb2.FromRank(**kind).SerializeToString())

    def start(self) -> None:
        """Hello, then the start-up phases (each reported as a Phase), then Ready."""
        cfg, phases = self.cfg, self.phases
        phases.enter(wire_pb2.PHASE_CONNECT)
        trusted = [load_public_key(k) for k in cfg.trusted_keys] if cfg.trusted_keys else None
        pkg = open_package(cfg.package, trusted_keys=trusted)
        self.hello = wire_pb2.Hello(
            rank=cfg.rank,
            tp_size=cfg.tp_size,
            package_digest=pkg.digest,
            pid=os.getpid(),
            hostname=socket.gethostname(),
        )
        self.send(hello=self.hello)
        if pkg.tp_size != cfg.tp_size:
            raise ValueError(
                f"the package is for TP {pkg.tp_size}, the rank was started for {cfg.tp_size}"
            )
        torch.set_num_threads(rank_threads(cfg))
        if cfg.device == "cuda":
            torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES leaves each rank one GPU: device 0
        phases.enter(wire_pb2.PHASE_JOIN_GROUP)
        with self.watchdog.watch(wire_pb2.PHASE_JOIN_GROUP):
            group = self._join_group()
        grammars = self._grammars(pkg)
        # The grammar compiler (importing xgrammar and transformers, reading the vocabulary:
        # seconds of Python) is built beside the load and waited for before Ready. Built after
        # Ready, its thread took the interpreter from the step loop: on the H200 the first ~15
        # requests of 2,112 tokens took 95-900 ms instead of 62, the first 3.4 s of a CPU
        # server's requests 2-30x their later time (2026-12-05).
        compiler = grammars.warm_async()
        draft = self._open_draft(pkg, trusted)
        runner, num_pages, drafter = self._load(pkg, group, draft)
        self.steps = self._executor(runner, pkg, drafter, grammars)
        if cfg.device == "cuda":
            self._warm_up(pkg.spec.vocab_size)
        compiler.join()
        phases.enter(wire_pb2.PHASE_COLLECTIVES_CHECK)
        with self.watchdog.watch(wire_pb2.PHASE_COLLECTIVES_CHECK):
            check = self._check_collectives(pkg)
        self.ready = wire_pb2.Ready(
            rank=cfg.rank,
            num_kv_pages=num_pages,
            device=cfg.device,
            startup_s=phases.elapsed_s(),
            kv_dtype=str(runner.kv.dtype).removeprefix("torch."),
            draft_digest=draft.digest if draft is not None else "",
            exact_rows=runner.exact_rows if cfg.device == "cuda" else 0,
        )
        if check is not None:
            self.ready.MergeFrom(wire_pb2.Ready(**dataclasses.asdict(check)))
        phases.current = wire_pb2.PHASE_UNSPECIFIED
        self.send(ready=self.ready)

    def _join_group(self) -> TPGroup:
        cfg = self.cfg
        if cfg.tp_size > 1:
            timeout = timedelta(seconds=120)
            dist.init_process_group(
                "nccl" if cfg.device == "cuda" else "gloo",
                store=rendezvous_store(cfg.dist_init, cfg.rank, cfg.tp_size, timeout),
                rank=cfg.rank,
                world_size=cfg.tp_size,
                timeout=timeout,
            )
            join_check(self.device)
        return TPGroup(cfg.rank, cfg.tp_size)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cfg.device == "cuda" else torch.device("cpu")

    def _open_draft(self, pkg: Package, trusted) -> Package | None:
        """Rank 0's draft package, checked against the served one; None without one (and on
        the other ranks, which never draft)."""
        if not self.cfg.draft_package or self.cfg.rank != 0:
            return None
        draft = open_package(self.cfg.draft_package, trusted_keys=trusted)
        check_draft(pkg, draft)
        return draft

    def _load(self, pkg: Package, group: TPGroup, draft: Package | None):
        """Load the shard (and the draft), allocate the KV cache (and capture graphs on
        CUDA); return the runner, its KV page count and the drafter (None without a draft)."""
        cfg, spec, caps = self.cfg, pkg.spec, pkg.capacities
        self.phases.enter(wire_pb2.PHASE_LOAD)
        tensors = pkg.load_shard(cfg.rank, self.device)
        model = build_model(spec, tensors, group, caps.max_seq_len, self.device, pkg.quant)
        draft_model = None
        if draft is not None:  # loaded before the KV pool is sized from what memory is left
            draft_model = build_model(
                draft.spec, draft.load_shard(0, self.device), TPGroup(0, 1),
                draft.capacities.max_seq_len, self.device, draft.quant,
            )  # fmt: skip
        self.phases.enter(wire_pb2.PHASE_KV_ALLOCATION)
        kv_quant = pkg.kv_quant(cfg.kv_dtype)
        if cfg.device == "cuda":
            return self._cuda_runners(model, caps, kv_quant, draft, draft_model)
        num_pages = cfg.kv_pages
        if not num_pages:
            page = KVCacheShape.for_spec(spec, cfg.tp_size, 1, caps.kv_page_size)
            num_pages = max(
                1, (cfg.kv_cache_mb << 20) // page.bytes(page_dtype(pkg.dtype, kv_quant))
            )
        shape = KVCacheShape.for_spec(spec, cfg.tp_size, num_pages, caps.kv_page_size)
        runner = ReferenceRunner(model, KVCache(shape, pkg.dtype, "cpu", kv_quant))
        drafter = None
        if draft is not None:
            draft_shape = KVCacheShape.for_spec(draft.spec, 1, num_pages, caps.kv_page_size)
            draft_kv = KVCache(draft_shape, draft.dtype, "cpu", None)
            drafter = _drafter(ReferenceRunner(draft_model, draft_kv), draft)
        return runner, num_pages, drafter

    def _cuda_runners(self, model, caps, kv_quant, draft: Package | None, draft_model):
        # runtime.cuda_runner.build_cuda_runner's steps, split so each phase is reported.
        from runtime.cuda_runner import CudaGraphRunner, CudaRunnerOptions

        shared = 0
        if draft is not None:
            draft_page = KVCacheShape.for_spec(draft.spec, 1, 1, caps.kv_page_size)
            shared = draft_page.bytes(draft.dtype)
        options = cuda_runner_options(self.cfg, kv_quant, shared)
        runner = CudaGraphRunner(model, caps, options)
        num_pages, drafter = runner.kv_plan.num_pages, None
        if draft is not None:
            draft_runner = CudaGraphRunner(
                draft_model,
                draft.capacities,
                # the draft proposes in one-row steps and never verifies
                CudaRunnerOptions(max_kv_pages=num_pages),
            )
            if draft_runner.kv_plan.num_pages < num_pages:
                raise ValueError(
                    f"the draft's KV pool holds {draft_runner.kv_plan.num_pages} pages, the "
                    f"served model's {num_pages}; pass a smaller --kv-pages"
                )
            drafter = _drafter(draft_runner, draft)
        self.phases.enter(wire_pb2.PHASE_GRAPH_CAPTURE)
        runner.capture()
        if drafter is not None:
            drafter.runner.capture()
        return runner, num_pages, drafter

    def _grammars(self, pkg: Package) -> GrammarMasks:
        return GrammarMasks(
            pkg.tokenizer_dir,
            list(pkg.manifest.tokenizer.eos_token_ids),
            pkg.spec.padded_vocab_size,
            pkg.capacities.max_batch,
            self.device,
        )

    def _executor(
        self, runner, pkg: Package, drafter: Drafter | None, grammars: GrammarMasks
    ) -> StepExecutor:
        max_batch = pkg.capacities.max_batch
        if self.cfg.device == "cuda":
            from runtime import cuda_sampling

            return StepExecutor(
                runner,
                self.cfg.rank,
                self.device,
                cuda_sampling.sample,
                cuda_sampling.sample_tokens,
                max_batch,
                grammars,
                drafter,
            )
        return StepExecutor(
            runner, self.cfg.rank, self.device, sample, None, max_batch, grammars, drafter
        )

    def _warm_up(self, vocab_size: int) -> None:
        """Compile the kernels that run outside the graphs (the draw, the grammar mask) before
        Ready, not inside the first request that needs them."""
        from runtime import cuda_sampling

        cuda_sampling.warm_up(vocab_size, self.device)
        logits = torch.zeros(2, vocab_size, device=self.device)
        self.steps.grammars.mask(logits, [None, None])  # all allowed: xgrammar's GPU kernel
        torch.cuda.synchronize(self.device)

    def _check_collectives(self, pkg: Package) -> CollectivesCheck | None:
        if self.cfg.tp_size == 1:
            return None
        hidden, max_batch = pkg.spec.hidden_size, pkg.capacities.max_batch
        return check_collectives(hidden, max_batch, pkg.dtype, self.device)

    def start_heartbeats(self) -> None:
        """Heartbeat from a thread with its own socket, so that the frontend hears from this
        rank during long steps too, and notices within seconds when it is stopped or hung."""
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rank-{self.cfg.rank}-heartbeat".encode())
        sock.setsockopt(zmq.LINGER, 0)
        if self.cfg.curve_dir:
            secure_client(sock, ClientKeys.load(Path(self.cfg.curve_dir), self.cfg.rank))
        sock.connect(self.cfg.frontend)
        while not self.closing.wait(self.cfg.heartbeat_s):
            beat = wire_pb2.Heartbeat(rank=self.cfg.rank, last_step_id=self.last_step)
            sock.send(wire_pb2.FromRank(heartbeat=beat).SerializeToString())
        sock.close()

    def serve(self) -> None:
        """Execute plans as they come. A launched step is reported as soon as its samples are
        on the host, or once the next plan, if it arrives first, has been launched behind it;
        so with the frontend one step ahead, the GPU always has the next step queued
        (ranks/steps.py)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        pending: Launched | None = None
        idle_since = time.perf_counter()  # when the last step was reported with none queued
        while True:
            if pending is not None:
                if self.steps.ready(pending):  # always on the CPU path: report at once
                    self._report(pending)
                    pending, idle_since = None, time.perf_counter()
                elif poller.poll(0):
                    msg = self._recv()
                    if msg.WhichOneof("kind") == "step":
                        pending = self._launch_behind(msg.step, pending)
                        continue
                    self._report(pending)
                    pending, idle_since = None, time.perf_counter()
                    if not self._control(msg):
                        return
                else:
                    time.sleep(20e-6)  # the GPU is still on it: look again for the next plan
                continue
            if not poller.poll(int(self.cfg.heartbeat_s * 1000)):
                if self.cfg.exit_with_parent and os.getppid() != self.parent_pid:
                    log.warning("the process that started this rank is gone; exiting")
                    return
                continue
            msg = self._recv()
            if msg.WhichOneof("kind") == "step":
                pending = self.steps.launch(msg.step, None, time.perf_counter() - idle_since)
            elif not self._control(msg):
                return

    def _launch_behind(self, plan: wire_pb2.StepPlan, pending: Launched) -> Launched:
        """Queue plan's step behind the unfinished `pending`, and report pending. A step whose
        draw is masked needs pending's tokens first anyway: pending is reported as soon as they
        are read, before the masks are filled, so the frontend plans the step after next while
        this rank fills them. Otherwise the draw is queued first and the report waits for the
        GPU behind it."""
        launched = self.steps.forward(plan, pending)
        if launched.masked:
            self._report(pending)
            self.steps.draw(launched, pending)
        else:
            self.steps.draw(launched, pending)
            self._report(pending)
        return launched

    def _recv(self) -> wire_pb2.ToRank:
        msg = wire_pb2.ToRank()
        msg.ParseFromString(self.sock.recv())
        return msg

    def _report(self, launched: Launched) -> None:
        result = self.steps.finish(launched)
        self.last_step = launched.step_id
        self.send(result=result)

    def _control(self, msg: wire_pb2.ToRank) -> bool:
        """Handle a message other than a step; False: stop serving."""
        kind = msg.WhichOneof("kind")
        if kind == "shutdown":
            return False
        if kind == "attach":
            log.info("frontend session %s attached", msg.attach.session_id)
            self.steps.reset()
            self.send(hello=self.hello)
            self.send(ready=self.ready)
        return True

    def close(self) -> None:
        self.closing.set()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.sock.close(linger=1000)
        self.ctx.term()


def cuda_runner_options(cfg: RankConfig, kv_quant, shared_page_bytes: int):
    """The served model's CudaRunnerOptions from the rank's settings: with exact verification,
    an exact graph for every decode bucket of up to cuda_ops.HALF_FEW_ROWS rows (the rows its
    one tile computes each as alone)."""
    from runtime import cuda_ops
    from runtime.cuda_runner import CudaRunnerOptions

    return CudaRunnerOptions(
        max_kv_pages=cfg.kv_pages,
        kv_quant=kv_quant,
        shared_page_bytes=shared_page_bytes,
        exact_verify_max_bucket=cuda_ops.HALF_FEW_ROWS if cfg.exact_verification else 0,
    )


def _drafter(runner, draft: Package) -> Drafter:
    caps = draft.capacities
    return Drafter(runner, draft.spec.vocab_size, caps.max_batch, caps.max_step_tokens)


def rank_threads(cfg: RankConfig) -> int:
    """torch's intra-op threads: --threads on CPU (0: every core). A CUDA rank gets one: its
    host tensors are small, and an OpenMP team on every core, spinning after each parallel op,
    took the cores from the threads that fill grammar masks (runtime/grammar.py)."""
    if cfg.device == "cuda":
        return 1
    return cfg.threads or torch.get_num_threads()


def rendezvous_store(dist_init: str, rank: int, tp_size: int, timeout: timedelta) -> dist.Store:
    """torch.distributed's TCPStore at dist_init (tcp://HOST:PORT). Rank 0 serves it from a
    socket bound to HOST alone: torch's own server would listen on every interface, and the
    store cannot be authenticated, so it must be reachable only on the cluster network."""
    parsed = urlsplit(dist_init)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise ValueError(f"--dist-init must be tcp://HOST:PORT, got {dist_init!r}")
    host, port = parsed.hostname, parsed.port
    if rank != 0:
        return dist.TCPStore(host, port, tp_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    # detach: the store's server owns the descriptor from here on (a collected socket object
    # would close it under the server).
    fd = listener.detach()
    return dist.TCPStore(host, port, tp_size, True, timeout, False, master_listen_fd=fd)


def main(cfg: RankConfig) -> int:
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"%(asctime)s rank-{cfg.rank} %(process)d %(levelname)s %(message)s",
    )
    rank = Rank(cfg)
    rank.start_heartbeats()
    try:
        rank.start()
        rank.serve()
    except Exception as e:
        log.exception("rank %d failed", cfg.rank)
        failure = wire_pb2.Failure(
            rank=cfg.rank, message=f"{type(e).__name__}: {e}", phase=rank.phases.current
        )
        rank.send(failure=failure)
        rank.close()
        return 1
    rank.close()
    return 0
