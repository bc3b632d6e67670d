"""Reading core.proto's StepOutputs whole: each sequence's output of a step as a SeqOutput,
the packed ones (next_keys, next_tokens) rebuilt, for the API servers' stream readers and the
engine's in-process owner alike."""

from collections.abc import Iterator

from proto import core_pb2


def seq_outputs(step: core_pb2.StepOutputs) -> Iterator[core_pb2.SeqOutput]:
    """The step's SeqOutputs, then one per packed sequence; raises ValueError, after the
    SeqOutputs, when the packed lists disagree in length."""
    yield from step.outputs
    keys, tokens = step.next_keys, step.next_tokens
    if len(keys) != len(tokens):
        raise ValueError(f"a step's packed outputs name {len(keys)} keys for {len(tokens)} tokens")
    for key, token in zip(keys, tokens):
        yield core_pb2.SeqOutput(seq_key=key, token_ids=(token,))
