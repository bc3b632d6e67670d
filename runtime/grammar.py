"""Grammar-constrained decoding on a rank (structured outputs), with xgrammar.

How this works: a sequence whose SamplingParams carry a `Grammar` starts compiling it when it
joins the rank (`GrammarMasks.start`), in the rank's one compile thread. Before a step draws,
`mask` fills one packed bitmask row per constrained sampling row on the CPU (allowed tokens: 1
bits), copies the rows to a buffer allocated once on the logits' device and sets every
disallowed logit to -inf in place; every unconstrained row's bitmask is all ones. After the draw the rank accepts each sampled token
into its matcher (`SeqGrammar.accept`). Every rank runs the same matchers on the same tokens,
so every rank masks, and so draws, the same.

A matcher is per-sequence state the rank owns, like its page table: dropped when the sequence
is released. Its position (`next_pos`) is explicit so that a sequence recomputed after a
preemption (its earlier output arriving as prefill tokens) replays that output into a fresh
matcher, and a token fed back by the core that the matcher already consumed is skipped.

Once the grammar is complete the matcher allows only the stop tokens (the package's EOS ids), so
the sequence ends with an EOS. A row drawn after that (the core is one step ahead) is left
unmasked: the core discards it.

The compile and the step loop. A sequence's first sampling row waits for its grammar: in the
meantime its prompt's prefill chunks and the step's forward pass run, but the wait itself holds
the rank's step, and so every stream of its rank group. Every rank waits at the same row for
the same deterministic compile, so the ranks stay in lock-step and draw the same tokens; a
schema that does not compile fails its sequence alone, on every rank alike. What bounds the
wait is the API server: it compiles each new schema the same way, in a child process with a
time and memory limit, and refuses one over them with a 400 before the core sees it
(orbit/http/schema_check.py). A rank thus never compiles a schema that took longer than that
limit to compile there. (Holding the sequence out of the batch until its grammar is ready on
every rank, as vLLM does, would remove even that wait, at the price of a scheduler state.)

Reading the tokenizer's vocabulary into xgrammar takes about a second for a 50k vocabulary (far
more on a loaded host); the rank does it in a thread beside its start-up and waits for it before
it reports Ready (`warm_async`): the first constrained request does not wait for it, and no
thread competes with the step loop for the interpreter once requests come. Compiled grammars
are cached by schema text (xgrammar's compiler cache, at most COMPILER_CACHE_BYTES).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from proto import wire_pb2

log = logging.getLogger(__name__)

# Whitespace inside the JSON is fixed (", " and ": "): with free whitespace a small model can
# emit newlines until max_tokens. The API server checks schemas with the same setting.
ANY_WHITESPACE = False
_ALL_ALLOWED = -1  # a bitmask word with every bit set
# Compiled grammars kept for schemas sent again; unbounded, distinct schemas would grow a rank.
COMPILER_CACHE_BYTES = 512 << 20


class GrammarError(ValueError):
    """A grammar the rank cannot compile or a token its matcher refuses."""


def reason(e: Exception) -> str:
    """xgrammar's error message without its log prefix."""
    # xgrammar's messages start with "[hh:mm:ss] /path/file.cc:line: "; keep what follows.
    text = str(e).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


@dataclass
class SeqGrammar:
    """One sequence's matcher and the position of the next token it consumes."""

    compiled: Future  # of its xgrammar.CompiledGrammar (GrammarMasks.start)
    next_pos: int  # tokens before this position are prompt or already consumed
    _matcher: object = None  # xgrammar.GrammarMatcher, made on first use

    def wait(self) -> None:
        """Block until the grammar is compiled; GrammarError when its schema did not compile."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result())

    @property
    def matcher(self):
        self.wait()
        return self._matcher

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_id: int, position: int) -> None:
        """Consume the output token at `position` unless already consumed."""
        if position < self.next_pos or self.terminated:
            return
        if not self.matcher.accept_token(token_id):
            raise GrammarError(f"the grammar refuses token {token_id} at position {position}")
        self.next_pos = position + 1

    def replay(self, token_ids: list[int], start_pos: int) -> None:
        """Consume the output tokens among a step's input tokens (a recompute after a
        preemption); prompt tokens and tokens already consumed are skipped."""
        for i, token_id in enumerate(token_ids):
            self.accept(token_id, start_pos + i)


class GrammarMasks:
    """A rank's compiler and mask buffers for its constrained sequences."""

    def __init__(
        self,
        tokenizer_dir: Path,
        stop_token_ids: list[int],
        vocab_size: int,
        max_batch: int,
        device: torch.device,
        threads: int | None = None,
    ):
        """vocab_size: the logits' width (padded vocabulary); ids past the tokenizer's are
        never allowed. threads: that fill a step's masks (None: mask_threads())."""
        self.tokenizer_dir, self.stop_token_ids = tokenizer_dir, list(stop_token_ids)
        self.vocab_size, self.max_batch, self.device = vocab_size, max_batch, device
        self._compiler = None
        self._compiler_lock = threading.Lock()
        # One thread: compiles queue behind each other, never beside the step loop's work twice.
        self._compiling = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        words = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        self._host = torch.full((max_batch, words), _ALL_ALLOWED, dtype=torch.int32, pin_memory=pin)
        self._dev = (
            self._host if device.type == "cpu" else torch.empty_like(self._host, device=device)
        )
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on the first mask
        self.threads = mask_threads() if threads is None else threads

    def start(self, grammar: wire_pb2.Grammar) -> SeqGrammar:
        """The sequence's grammar, compiling in the background: its first masked row waits for
        it, so the compile overlaps the prompt's prefill."""
        compiled = self._compiling.submit(self._compile, grammar.json_schema)
        return SeqGrammar(compiled, grammar.num_prompt_tokens)

    def _compile(self, json_schema: str):
        try:
            return self._get_compiler().compile_json_schema(
                json_schema, any_whitespace=ANY_WHITESPACE
            )
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
            raise GrammarError(reason(e)) from None

    def warm_async(self) -> threading.Thread:
        """Build the compiler in a daemon thread (returned, to join); a failure there leaves it
        to the first grammar, which then raises it."""
        thread = threading.Thread(target=self._warm, name="grammar-warmup", daemon=True)
        thread.start()
        return thread

    def _warm(self) -> None:
        try:
            self._get_compiler()
        except Exception:  # noqa: BLE001 - raised again, with its reason, by the first grammar
            log.warning("building the grammar compiler failed; the first grammar will retry")

    def _get_compiler(self):
        with self._compiler_lock:
            return self._build_compiler()

    def _build_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES
            )
        return self._compiler

    def mask(self, logits: torch.Tensor, rows: list[SeqGrammar | None]) -> None:
        """logits: [n, vocab] float32, one row per entry of rows (None: unconstrained); the
        disallowed logits of constrained, unfinished rows become -inf in place."""
        n = len(rows)
        host = self._host[:n]
        host.fill_(_ALL_ALLOWED)
        live = [(i, g.matcher) for i, g in enumerate(rows) if g is not None and not g.terminated]
        threads = self.threads
        if len(live) > 1 and threads > 1:
            # One row's mask costs tens to hundreds of µs (more inside a JSON string): a batch's
            # rows are filled by xgrammar's threads, not one by one on the step loop's thread.
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
            self._batch.batch_fill_next_token_bitmask(
                [m for _, m in live], self._host, [i for i, _ in live]
            )
        else:
            for i, matcher in live:
                matcher.fill_next_token_bitmask(self._host, i)
        dev = self._dev[:n]
        if dev is not host:
            # Safe to refill the host rows next step: the rank reads this step's samples back
            # (ranks/steps.py) before it masks again, and this copy precedes them on the stream.
            dev.copy_(host, non_blocking=True)
        apply_bitmask(logits, dev)


def mask_threads() -> int:
    """Threads that fill a step's masks: half the cores this process may use (the rest run
    the step loop and its neighbours), at most 8 (beyond, a batch's rows are too few)."""
    return max(1, min(8, _cores // 2))


_cores = len(os.sched_getaffinity(0))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [n, vocab] float32; bitmask [n, ceil(vocab / 32)] int32, bit j of word w allows
    token 32 * w + j. xgrammar's kernel: a CPU loop, or one Triton kernel on the GPU that
    reads the bitmask buffer in place (no allocation)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
