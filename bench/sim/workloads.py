"""Simulator workloads: requests as sequences of *units*.

A unit is one token for the generated workloads (``unit_tokens == 1``) and one trace block for
trace files (512 tokens for Mooncake, 64 for WEKA): the radix tree of a trace is built over block
ids, page_size 1. Hit rates are token-weighted: a request whose first ``h`` units are cached
hits ``min(h * unit_tokens, prompt_tokens - 1)`` tokens (the last prompt token is always
computed; a trace's last block may be partial).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from bench.common import random_ids, rng

VOCAB = 32000


@dataclass(slots=True)
class Request:
    units: list[int]  # the prompt, in units
    prompt_tokens: int  # L: prompt length in tokens
    stored: list[int]  # units cached once the request finished (prompt [+ output]); units is a prefix
    stored_tokens: int  # tokens covered by ``stored`` (a trace's last block may be partial)
    t: float = 0.0  # arrival (for ordering only)
    after: int = -1  # index of the request this one waits for (previous turn), -1 for none

    def hit_tokens(self, h: int, unit_tokens: int) -> int:
        """Token hit of ``h`` cached leading units."""
        return min(h * unit_tokens, self.prompt_tokens - 1) if h > 0 else 0

    def access_units(self, unit_tokens: int) -> int:
        """Leading units whose hit is worth tokens (past ``prompt_tokens - 1`` nothing counts)."""
        return min(len(self.units), -(-(self.prompt_tokens - 1) // unit_tokens))


@dataclass
class Workload:
    name: str
    requests: list[Request]
    unit_tokens: int = 1
    description: str = ""
    info: dict = field(default_factory=dict)
    _paths: list[list[int]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    def paths(self) -> list[list[int]]:
        """Per request, a node id per stored unit in the trie of all stored sequences: node id
        identifies the whole prefix up to that unit (two requests share node k iff they share
        the first k+1 units). Built once; the bounds and block hashing key on these ids."""
        if self._paths is None:
            trie: dict = {}
            out = []
            shift = max((max(r.stored) for r in self.requests if r.stored), default=0) + 1
            for r in self.requests:
                node, ids = 0, []
                for u in r.stored:
                    key = node * shift + u
                    nxt = trie.get(key)
                    if nxt is None:
                        nxt = trie[key] = len(trie) + 1
                    ids.append(nxt)
                    node = nxt
                out.append(ids)
            self._paths = out
            self.info["distinct_units"] = len(trie)
        return self._paths

    @property
    def distinct_units(self) -> int:
        self.paths()
        return self.info["distinct_units"]


# -- generated workloads -----------------------------------------------------------------------
def agent_fleet(agents=64, system_tokens=2048, private_tokens=128, turns=4, output_tokens=8, observation_tokens=16, seed=7) -> Workload:
    """A agents share an S-token system prompt, each has a P-token private state; turn t's prompt
    is turn t-1's prompt + its output + an observation. Closed loop approximated by round robin
    over the agents per turn."""
    g = rng(seed, 1)
    system = random_ids(g, system_tokens, VOCAB)
    prompts = [system + random_ids(g, private_tokens, VOCAB) for _ in range(agents)]
    reqs: list[Request] = []
    last = [-1] * agents
    for t in range(turns):
        for a in range(agents):
            prompt = prompts[a]
            out = random_ids(g, output_tokens, VOCAB)
            stored = prompt + out
            reqs.append(Request(prompt, len(prompt), stored, len(stored), float(t), last[a]))
            last[a] = len(reqs) - 1
            prompts[a] = stored + random_ids(g, observation_tokens, VOCAB)
    return Workload(
        "fleet",
        reqs,
        1,
        f"agent fleet: {agents} agents x {turns} turns, system {system_tokens}, "
        f"private {private_tokens}, output {output_tokens}, observation {observation_tokens}",
    )


def shared_prefix(groups=64, prompts=16, system_tokens=2048, question_tokens=128, output_tokens=256, seed=7) -> Workload:
    """SGLang generated-shared-prefix: G groups x Q prompts (group prefix + unique question),
    shuffled."""
    g = rng(seed, 2)
    reqs = []
    for _ in range(groups):
        prefix = random_ids(g, system_tokens, VOCAB)
        for _ in range(prompts):
            prompt = prefix + random_ids(g, question_tokens, VOCAB)
            stored = prompt + random_ids(g, output_tokens, VOCAB)
            reqs.append(Request(prompt, len(prompt), stored, len(stored)))
    order = g.permutation(len(reqs)).tolist()
    reqs = [reqs[i] for i in order]
    for i, r in enumerate(reqs):
        r.t = float(i)
    return Workload(
        "gsp",
        reqs,
        1,
        f"generated shared prefix: {groups} groups x {prompts} prompts, system {system_tokens}, question {question_tokens}, output {output_tokens}, shuffled",
    )


def multi_turn_chat(conversations=32, turns=8, system_tokens=256, user_tokens=64, output_tokens=128, seed=7) -> Workload:
    """C conversations with a shared system prompt; turn t = everything so far + a new user
    message; conversations interleave in a random order that keeps each one's turns in order."""
    g = rng(seed, 3)
    system = random_ids(g, system_tokens, VOCAB)
    history = [list(system) for _ in range(conversations)]
    left = [turns] * conversations
    last = [-1] * conversations
    reqs = []
    while any(left):
        live = [c for c in range(conversations) if left[c]]
        c = live[int(g.integers(len(live)))]
        prompt = history[c] + random_ids(g, user_tokens, VOCAB)
        stored = prompt + random_ids(g, output_tokens, VOCAB)
        reqs.append(Request(prompt, len(prompt), stored, len(stored), float(len(reqs)), last[c]))
        last[c] = len(reqs) - 1
        history[c] = stored
        left[c] -= 1
    return Workload(
        "chat",
        reqs,
        1,
        f"multi-turn chat: {conversations} conversations x {turns} turns, system {system_tokens}, user {user_tokens}, output {output_tokens}, interleaved",
    )


# -- traces ------------------------------------------------------------------------------------
def load_mooncake(path: str, limit: int | None = None) -> Workload:
    """Mooncake jsonl: 512-token chained ``hash_ids``, the last block partial."""
    reqs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            ids = [int(h) for h in d["hash_ids"]]
            L = int(d["input_length"])
            reqs.append(Request(ids, L, ids, L, float(d.get("timestamp", len(reqs)))))
            if limit and len(reqs) >= limit:
                break
    return Workload("mooncake", reqs, 512, f"Mooncake trace {os.path.basename(path)}: {len(reqs)} requests, 512-token blocks")


def load_weka(paths: list[str], limit: int | None = None) -> Workload:
    """WEKA sessions (one JSON per session): 64-token full blocks, ids local per session, so
    each (session, id) becomes its own unit: sessions share nothing. Sub-agents share the
    parent's namespace and run as their own chain from the parent's time. Sessions all start
    at t=0 and interleave by time."""
    intern: dict = {}
    items = []  # (t, chain key, seq, Request)
    for sid, path in enumerate(sorted(paths)):
        with open(path) as f:
            d = json.load(f)
        B = int(d.get("block_size", 64))
        if B != 64:
            raise ValueError(f"{path}: block_size {B}, expected 64")

        def add(entries, t0, chain, sid=sid, B=B):  # this session's sid and B, bound now
            for e in entries:
                if e.get("type") == "subagent" and "requests" in e:
                    add(e["requests"], t0 + float(e.get("t", 0.0)), (sid, e.get("agent_id", id(e))), sid, B)
                    continue
                if "hash_ids" not in e or "in" not in e:
                    continue
                ids = [intern.setdefault((sid, int(h)), len(intern)) for h in e["hash_ids"]]
                L = int(e["in"])
                items.append((t0 + float(e.get("t", 0.0)), chain, len(items), Request(ids, L, ids, min(L, len(ids) * B))))

        add(d["requests"], 0.0, (sid, None))
    items.sort(key=lambda x: (x[0], x[2]))
    if limit:
        items = items[:limit]
    reqs, last = [], {}
    for t, chain, _, r in items:
        r.t = t
        r.after = last.get(chain, -1)
        last[chain] = len(reqs)
        reqs.append(r)
    return Workload("weka", reqs, 64, f"WEKA sessions: {len(paths)} files, {len(reqs)} requests, 64-token blocks")


def load_trace(path: str, limit: int | None = None) -> Workload:
    """A Mooncake ``.jsonl``, a WEKA session ``.json``, or a directory of either."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")))
        if files:
            return load_weka(files, limit)
        files = sorted(glob.glob(os.path.join(path, "*.jsonl")))
        if len(files) == 1:
            return load_mooncake(files[0], limit)
        raise ValueError(f"{path}: expected WEKA *.json files or one Mooncake *.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace not found: {path}")
    if path.endswith(".jsonl"):
        return load_mooncake(path, limit)
    return load_weka([path], limit)
