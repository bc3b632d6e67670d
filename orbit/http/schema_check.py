"""The API server's check of a JSON schema before its request reaches the engine core: the
schema is compiled for the served tokenizer, exactly as every rank will compile it, in a child
process with a time and a memory limit.

Why a bound, and why here. A rank compiles a sequence's grammar in lock-step with the other
ranks (runtime/grammar.py): while it waits for the compile, no stream of that rank group gets a
token. xgrammar's compile time is not bounded by the schema's size: a 30-byte `pattern` such
as `^(.{1,30}x){1,40}$` takes 11 s and a 1 MB enum of 50,000 strings 18 s and 200 MB (2-core
test machine). So the API server compiles each new schema first, with the same settings and
tokenizer, and refuses with a 400 one that does not compile within COMPILE_TIMEOUT_S or whose
compiled grammar is over MAX_GRAMMAR_BYTES: what a rank then spends on any schema it is sent
is bounded by what this check measured (compiling is deterministic; both use one thread).

Why a child process. A compile cannot be interrupted from Python, so a thread that ran over its
limit would keep a core (and its memory) until xgrammar finished, however long that is; a child
is killed at the deadline and started again. Its address space is capped
(COMPILE_MEMORY_BYTES above what it uses when idle), so a grammar that would need more fails
there, not in the API server. One child per API server compiles one schema at a time; outcomes
are remembered by schema text (CACHE_ENTRIES), so a schema sent again costs nothing. Refusals
for time are not remembered: a compile slowed by a busy host may pass on a retry.

The child (`python -m orbit.http.schema_check`) reads the tokenizer as xgrammar's serialized
TokenizerInfo on its first stdin line, then one JSON-encoded schema text per line, and answers
each with one JSON line: {"compile_s", "size_bytes"} or {"error", "memory"}.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict

from runtime.grammar import ANY_WHITESPACE, GrammarError, reason

# A rank's step loop may wait this long for a new schema's grammar; typical schemas compile in
# 5-100 ms, and 600 ms was the slowest of the tests' (1,000 required properties).
COMPILE_TIMEOUT_S = 2.0
# Every rank keeps a compiled grammar while a sequence uses it (and in its compiler's cache).
MAX_GRAMMAR_BYTES = 64 << 20
COMPILE_MEMORY_BYTES = 1 << 30
CACHE_ENTRIES = 1024
# The child imports xgrammar (and with it torch and transformers): seconds on a busy host.
START_TIMEOUT_S = 120.0


class SchemaTooCostly(GrammarError):
    """A schema whose grammar takes too long or too much memory to compile."""


class _TooSlow(SchemaTooCostly):
    """Not remembered: the same schema may compile in time on a less busy host."""


_UNKNOWN = object()  # a schema not checked yet


class SchemaChecker:
    """Compiles schemas in a child process, one at a time; thread-safe."""

    def __init__(
        self,
        tokenizer,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
    ):
        """tokenizer: the served Hugging Face tokenizer (its vocabulary is what a grammar's
        token masks are computed over)."""
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self._child_lock = threading.Lock()  # one compile at a time
        self._outcomes_lock = threading.Lock()  # a remembered schema never waits for a compile
        self._tokenizer_info: str | None = None
        self._child: subprocess.Popen | None = None
        self._outcomes: OrderedDict[str, GrammarError | None] = OrderedDict()  # by schema
        self._finalizer = None

    def warm_async(self) -> None:
        """Start the child in a daemon thread, so the first schema does not wait for it."""
        threading.Thread(target=self._warm, name="schema-check-warmup", daemon=True).start()

    def _warm(self) -> None:
        with self._child_lock:
            self._started()

    def check(self, json_schema: str) -> None:
        """Raise GrammarError (SchemaTooCostly for time or memory) with the reason when the
        schema is refused."""
        refusal = self._remembered(json_schema)
        if refusal is _UNKNOWN:
            with self._child_lock:
                refusal = self._compile(json_schema)
            if not isinstance(refusal, _TooSlow):
                self._remember(json_schema, refusal)
        if refusal is not None:
            raise type(refusal)(str(refusal))  # a fresh one: a raise extends its traceback

    def _remembered(self, json_schema: str) -> GrammarError | None | object:
        with self._outcomes_lock:
            if json_schema not in self._outcomes:
                return _UNKNOWN
            self._outcomes.move_to_end(json_schema)
            return self._outcomes[json_schema]

    def _remember(self, json_schema: str, refusal: GrammarError | None) -> None:
        with self._outcomes_lock:
            self._outcomes[json_schema] = refusal
            if len(self._outcomes) > CACHE_ENTRIES:
                self._outcomes.popitem(last=False)

    def _compile(self, json_schema: str) -> GrammarError | None:
        child = self._started()
        child.stdin.write(json.dumps(json_schema) + "\n")
        child.stdin.flush()
        line = _read_line(child, self.timeout_s)
        if line is None:
            self._stop()
            return _TooSlow(
                f"its grammar did not compile within {self.timeout_s:g} s, the limit that keeps "
                "the other streams' steps flowing; simplify it (fewer enum values or "
                "properties, bounded repetitions in patterns)"
            )
        if not line:
            self._stop()
            return SchemaTooCostly("compiling its grammar failed: the checker process exited")
        return self._refusal(json.loads(line))

    def _refusal(self, reply: dict) -> GrammarError | None:
        if reply.get("memory"):
            self._stop()  # after a failed allocation the child is not trusted again
            return SchemaTooCostly(
                f"its grammar needs more than {COMPILE_MEMORY_BYTES >> 20} MiB to compile; "
                "simplify it"
            )
        if "error" in reply:
            return GrammarError(reply["error"])
        if reply["size_bytes"] > self.max_grammar_bytes:
            return SchemaTooCostly(
                f"its compiled grammar takes {reply['size_bytes']:,} bytes, over the limit of "
                f"{self.max_grammar_bytes:,}; simplify it"
            )
        return None

    def _started(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        if self._tokenizer_info is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=len(self.tokenizer)
            )
            self._tokenizer_info = info.serialize_json()
        child = subprocess.Popen(
            [sys.executable, "-m", "orbit.http.schema_check"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=_REPO_ROOT,
        )
        child.stdin.write(self._tokenizer_info + "\n")
        child.stdin.flush()
        if _read_line(child, START_TIMEOUT_S) != "ready\n":
            child.kill()
            child.wait()
            raise RuntimeError("the schema checker process did not start")
        self._child = child
        # Closing its stdin ends the child when this checker is collected (tests make many).
        self._finalizer = weakref.finalize(self, _close, child)
        return child

    def _stop(self) -> None:
        """Kill the child and start the next one at once, for the next new schema."""
        if self._child is not None:
            self._finalizer.detach()
            self._child.kill()
            self._child.wait()
            _close(self._child)
            self._child = None
        self.warm_async()


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read_line(child: subprocess.Popen, timeout_s: float) -> str | None:
    """The child's next line ("" when it exited), or None after timeout_s. The child writes
    one line per request, so the text reader never holds part of a later answer."""
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    return child.stdout.readline() if ready else None


def _close(child: subprocess.Popen) -> None:
    for pipe in (child.stdin, child.stdout):
        try:
            pipe.close()
        except OSError:
            pass


def main() -> int:
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _cap_memory(COMPILE_MEMORY_BYTES)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_compile_one(compiler, json.loads(line))), flush=True)
    return 0


def _exit_with_parent() -> None:
    """A compile does not read stdin, so it would outlive an API server that was killed."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _compile_one(compiler, json_schema: str) -> dict:
    started = time.perf_counter()
    try:
        compiled = compiler.compile_json_schema(json_schema, any_whitespace=ANY_WHITESPACE)
    except MemoryError:
        return {"error": "out of memory", "memory": True}
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
        text = reason(e)
        return {"error": text, "memory": "bad_alloc" in text}
    return {"compile_s": time.perf_counter() - started, "size_bytes": compiled.memory_size_bytes}


def _cap_memory(headroom_bytes: int) -> None:
    """Cap the address space at what the process maps now plus headroom_bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmSize:"))
    limit = int(line.split()[1]) * 1024 + headroom_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    sys.exit(main())
