"""Seeded workloads for the lab, and their JSONL form.

A workload is a set of sessions, each an optional shared prefix and turns whose prompts resend
the whole conversation; generators for chat, agentic, RAG and long-context workloads (same
arguments, same workload). The model and the JSONL format: docs/lab.md#labworkloads.
"""

from __future__ import annotations

import inspect
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "WORKLOADS",
    "Session",
    "Turn",
    "Workload",
    "WorkloadError",
    "load_jsonl",
    "make_agentic_workload",
    "make_chat_workload",
    "make_long_context_workload",
    "make_rag_workload",
    "make_workload",
    "save_jsonl",
]

JSONL_VERSION = 1


class WorkloadError(ValueError):
    """A workload file or generator argument that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Turn:
    user: tuple[int, ...]  # the turn's new tokens (user message, tool output, question)
    output: tuple[int, ...]  # the tokens the "model" answers with


@dataclass(frozen=True, slots=True)
class Session:
    session_id: int
    prefix: int | None  # index into Workload.prefixes, or None
    turns: tuple[Turn, ...]
    arrival: int = 0  # step at which the first turn arrives

    # The allocator benchmark's names for the same fields.
    @property
    def conv_id(self) -> int:
        return self.session_id

    @property
    def system(self) -> int | None:
        return self.prefix


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str
    seed: int
    prefixes: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...]

    @property
    def system_prompts(self) -> tuple[tuple[int, ...], ...]:
        return self.prefixes

    @property
    def conversations(self) -> tuple[Session, ...]:
        return self.sessions

    def prompt(self, session: Session, k: int) -> list[int]:
        """Turn ``k``'s prompt: prefix + earlier turns (new tokens + output) + new tokens."""
        toks = [] if session.prefix is None else list(self.prefixes[session.prefix])
        for t in session.turns[:k]:
            toks += t.user
            toks += t.output
        toks += session.turns[k].user
        return toks

    @staticmethod
    def request_id(session: Session, k: int) -> str:
        return f"c{session.session_id}t{k}"

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def summary(self) -> dict[str, int]:
        prompt_tokens = sum(
            len(self.prompt(s, k)) for s in self.sessions for k in range(len(s.turns))
        )
        output_tokens = sum(len(t.output) for s in self.sessions for t in s.turns)
        return {
            "conversations": len(self.sessions),
            "turns": self.num_turns,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
        }


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------


def _check_range(name: str, value: tuple[int, int], minimum: int) -> None:
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and minimum <= value[0] <= value[1]
    )
    if not ok:
        raise WorkloadError(f"{name}={value!r}: needs (lo, hi) ints with {minimum} <= lo <= hi")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise WorkloadError(f"{name}={value!r}: needs an int >= {minimum}")


# The least value of every generator argument: counts, and (lo, hi) ranges (both ends).
_COUNTS = {
    "num_system_prompts": 1,
    "num_preambles": 1,
    "num_documents": 1,
    "num_conversations": 0,
    "num_sessions": 0,
    "vocab_size": 1,
}
_RANGES = {
    "system_len": 1,
    "preamble_len": 1,
    "document_len": 1,
    "prompt_len": 1,
    "turns": 1,
    "user_len": 1,
    "tool_output_len": 1,
    "question_len": 1,
    "output_len": 1,
    "arrival_gap": 0,
}


def _check_args(args: dict) -> None:
    """Check a generator's arguments against `_COUNTS` and `_RANGES`, the counts first.

    Args:
        args: the generator's ``locals()`` on entry (its parameters; ``seed`` is not checked).
    """
    for name, value in args.items():
        if name in _COUNTS:
            _check_int(name, value, _COUNTS[name])
    for name, value in args.items():
        if name in _RANGES:
            _check_range(name, value, _RANGES[name])


def _tokens(rng: random.Random, vocab_size: int):
    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(n))

    return toks


def _over_shared_prefixes(
    kind: str,
    seed: int,
    vocab_size: int,
    prefix_len: tuple[int, int],
    num_prefixes: int,
    num_sessions: int,
    turns: tuple[int, int],
    turn_len: tuple[tuple[int, int], tuple[int, int]],
    arrival_gap: tuple[int, int] | None,
) -> Workload:
    """Sessions that each open with one of ``num_prefixes`` shared prefixes, then ``turns``
    turns of ``turn_len`` (new tokens, output) tokens, arriving ``arrival_gap`` steps apart (all
    at step 0 when None). The random draws, in order: the prefixes, then per session its prefix,
    its number of turns, each turn's two lengths, its arrival gap."""
    rng = random.Random(seed)
    toks = _tokens(rng, vocab_size)
    prefixes = tuple(toks(rng.randint(*prefix_len)) for _ in range(num_prefixes))
    user_len, output_len = turn_len
    sessions, arrival = [], 0
    for sid in range(num_sessions):
        prefix = rng.randrange(num_prefixes)
        n_turns = rng.randint(*turns)
        session_turns = tuple(
            Turn(user=toks(rng.randint(*user_len)), output=toks(rng.randint(*output_len)))
            for _ in range(n_turns)
        )
        sessions.append(Session(sid, prefix, session_turns, arrival))
        if arrival_gap is not None:
            arrival += rng.randint(*arrival_gap)
    return Workload(kind=kind, seed=seed, prefixes=prefixes, sessions=tuple(sessions))


def make_chat_workload(
    seed: int = 0,
    *,
    num_system_prompts: int = 8,
    num_conversations: int = 200,
    system_len: tuple[int, int] = (1024, 4096),
    turns: tuple[int, int] = (1, 5),
    user_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (16, 512),
    vocab_size: int = 100_000,
) -> Workload:
    """Multi-turn chat: conversations over ``num_system_prompts`` shared system prompts; every
    range is inclusive. The allocator benchmark's workload (its random draws are fixed: the
    recorded vLLM decisions depend on them)."""
    _check_args(locals())
    return _over_shared_prefixes(
        "chat", seed, vocab_size, system_len, num_system_prompts, num_conversations, turns,
        (user_len, output_len), None,
    )  # fmt: skip


def make_agentic_workload(
    seed: int = 0,
    *,
    num_preambles: int = 2,
    num_sessions: int = 40,
    preamble_len: tuple[int, int] = (4096, 12288),
    turns: tuple[int, int] = (6, 20),
    tool_output_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (16, 160),
    arrival_gap: tuple[int, int] = (0, 8),
    vocab_size: int = 100_000,
) -> Workload:
    """Agentic sessions: a long shared preamble (system prompt and tool schemas), then many
    short turns in which the new tokens are tool outputs and the answers are short tool calls.
    Sessions arrive ``arrival_gap`` steps apart."""
    _check_args(locals())
    return _over_shared_prefixes(
        "agentic", seed, vocab_size, preamble_len, num_preambles, num_sessions, turns,
        (tool_output_len, output_len), arrival_gap,
    )  # fmt: skip


def make_rag_workload(
    seed: int = 0,
    *,
    num_documents: int = 4,
    num_sessions: int = 120,
    document_len: tuple[int, int] = (6144, 12288),
    turns: tuple[int, int] = (1, 2),
    question_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (32, 256),
    arrival_gap: tuple[int, int] = (0, 4),
    vocab_size: int = 100_000,
) -> Workload:
    """Retrieval-augmented questions: a few long documents, each shared by many sessions of
    one or two short questions."""
    _check_args(locals())
    return _over_shared_prefixes(
        "rag", seed, vocab_size, document_len, num_documents, num_sessions, turns,
        (question_len, output_len), arrival_gap,
    )  # fmt: skip


def make_long_context_workload(
    seed: int = 0,
    *,
    num_sessions: int = 4,
    prompt_len: tuple[int, int] = (32768, 100_000),
    output_len: tuple[int, int] = (128, 512),
    arrival_gap: tuple[int, int] = (0, 64),
    vocab_size: int = 100_000,
) -> Workload:
    """Long single requests (whole documents or code bases), nothing shared."""
    _check_args(locals())
    rng = random.Random(seed)
    toks = _tokens(rng, vocab_size)
    sessions, arrival = [], 0
    for sid in range(num_sessions):
        turn = Turn(user=toks(rng.randint(*prompt_len)), output=toks(rng.randint(*output_len)))
        sessions.append(Session(session_id=sid, prefix=None, turns=(turn,), arrival=arrival))
        arrival += rng.randint(*arrival_gap)
    return Workload(kind="long_context", seed=seed, prefixes=(), sessions=tuple(sessions))


WORKLOADS = {
    "chat": make_chat_workload,
    "agentic": make_agentic_workload,
    "rag": make_rag_workload,
    "long_context": make_long_context_workload,
}


def make_workload(kind: str, seed: int = 0, **kwargs) -> Workload:
    """The generator ``kind`` (`WORKLOADS`) with its keyword arguments."""
    if kind not in WORKLOADS:
        raise WorkloadError(f"unknown workload {kind!r}; known: {sorted(WORKLOADS)}")
    names = list(inspect.signature(WORKLOADS[kind]).parameters)[1:]  # after the seed
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise WorkloadError(
            f"workload {kind!r} has no argument {', '.join(map(repr, unknown))}; its arguments: "
            f"{', '.join(names)}"
        )
    try:
        return WORKLOADS[kind](seed, **kwargs)
    except TypeError as e:  # a value of the wrong kind
        raise WorkloadError(f"workload {kind!r}: {e}") from None


# --------------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------------


def _lines(workload: Workload) -> Iterator[dict]:
    yield {"workload": workload.kind, "seed": workload.seed, "version": JSONL_VERSION}
    for i, tokens in enumerate(workload.prefixes):
        yield {"prefix": i, "tokens": list(tokens)}
    for s in workload.sessions:
        for k, t in enumerate(s.turns):
            yield {
                "session": s.session_id,
                "turn": k,
                "prefix": s.prefix,
                "arrival": s.arrival,
                "user": list(t.user),
                "output": list(t.output),
            }


def save_jsonl(workload: Workload, path: str | os.PathLike) -> None:
    """Write ``workload`` as JSONL (module docstring); `load_jsonl` reads it back equal."""
    with open(path, "w") as f:
        for line in _lines(workload):
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def _token_list(where: str, key: str, value, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise WorkloadError(f"{where}: {key!r} must be a list of token ids (ints >= 0)")
    if not value and not allow_empty:
        raise WorkloadError(f"{where}: {key!r} is empty")
    return tuple(value)


def _int_field(where: str, obj: dict, key: str, minimum: int, optional: bool = False):
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise WorkloadError(f"{where}: {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def load_jsonl(path: str | os.PathLike) -> Workload:
    """Read a workload written by `save_jsonl` (or a trace in the same format).

    Raises:
        WorkloadError: naming the file and line of the first malformed line (not JSON, an
            unknown or missing key, a token that is not an int >= 0, a turn out of order, a
            prefix used before it is defined, a session whose turns disagree).
    """
    return _parse(str(path), _read_lines(path))


def _read_lines(path: str | os.PathLike) -> Iterable[tuple[int, str]]:
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield number, line
    except OSError as e:
        raise WorkloadError(f"cannot read workload file {path}: {e}") from None


def _parse(name: str, lines: Iterable[tuple[int, str]]) -> Workload:
    header = None
    prefixes: dict[int, tuple[int, ...]] = {}
    sessions: dict[int, dict] = {}
    for number, line in lines:
        where = f"{name} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object")
        if header is None:
            header = _parse_header(where, obj)
        elif "prefix" in obj and "tokens" in obj:
            _parse_prefix(where, obj, prefixes)
        else:
            _parse_turn(where, obj, prefixes, sessions)
    if header is None:
        raise WorkloadError(f"{name}: empty workload file (no header line)")
    kind, seed = header
    return Workload(
        kind=kind,
        seed=seed,
        prefixes=tuple(prefixes[i] for i in range(len(prefixes))),
        sessions=tuple(
            Session(
                session_id=sid, prefix=s["prefix"], turns=tuple(s["turns"]), arrival=s["arrival"]
            )
            for sid, s in sessions.items()
        ),
    )


def _parse_header(where: str, obj: dict) -> tuple[str, int]:
    """The first line's (workload kind, seed)."""
    if set(obj) != {"workload", "seed", "version"}:
        raise WorkloadError(
            f"{where}: the first line must be the header "
            '{"workload": ..., "seed": ..., "version": 1}'
        )
    if obj["version"] != JSONL_VERSION:
        raise WorkloadError(f"{where}: version {obj['version']!r}; allowed: 1")
    if not isinstance(obj["workload"], str):
        raise WorkloadError(f"{where}: 'workload' must be a string")
    return obj["workload"], _int_field(where, obj, "seed", -(2**63))


def _parse_prefix(where: str, obj: dict, prefixes: dict[int, tuple[int, ...]]) -> None:
    """Add a prefix line's tokens to ``prefixes`` (they come in order)."""
    if set(obj) != {"prefix", "tokens"}:
        raise WorkloadError(f"{where}: a prefix line has keys 'prefix' and 'tokens' only")
    index = _int_field(where, obj, "prefix", 0)
    if index != len(prefixes):
        raise WorkloadError(f"{where}: prefix {index} out of order (next is {len(prefixes)})")
    prefixes[index] = _token_list(where, "tokens", obj["tokens"], allow_empty=False)


def _parse_turn(where: str, obj: dict, prefixes: dict, sessions: dict[int, dict]) -> None:
    """Add a turn line to its session in ``sessions`` (opened by its first turn)."""
    keys = {"session", "turn", "prefix", "arrival", "user", "output"}
    if set(obj) != keys:
        extra, missing = sorted(set(obj) - keys), sorted(keys - set(obj))
        raise WorkloadError(
            f"{where}: a turn line has keys {sorted(keys)}"
            + (f"; unknown {extra}" if extra else "")
            + (f"; missing {missing}" if missing else "")
        )
    sid = _int_field(where, obj, "session", 0)
    k = _int_field(where, obj, "turn", 0)
    prefix = _int_field(where, obj, "prefix", 0, optional=True)
    arrival = _int_field(where, obj, "arrival", 0)
    if prefix is not None and prefix not in prefixes:
        raise WorkloadError(f"{where}: prefix {prefix} is not defined above this line")
    user = _token_list(where, "user", obj["user"], allow_empty=prefix is not None or k > 0)
    output = _token_list(where, "output", obj["output"], allow_empty=False)
    s = sessions.setdefault(sid, {"prefix": prefix, "arrival": arrival, "turns": []})
    if (s["prefix"], s["arrival"]) != (prefix, arrival):
        raise WorkloadError(
            f"{where}: session {sid} has prefix={s['prefix']!r}, arrival={s['arrival']!r} "
            f"on its first turn but prefix={prefix!r}, arrival={arrival!r} here"
        )
    if k != len(s["turns"]):
        raise WorkloadError(
            f"{where}: session {sid} turn {k} out of order (next is {len(s['turns'])})"
        )
    s["turns"].append(Turn(user=user, output=output))
