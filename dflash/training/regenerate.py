"""Chat data for a real target: its own answers to the conversations' user turns.

A drafter learns to predict what the *target* writes, so the assistant turns
of a chat data set are thrown away and written again by the target, through
its own chat template, in the thinking mode the drafter will serve (a drafter
trained on the other mode's text accepts little). Input, one conversation per
line, in either of the two common forms::

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}

Every assistant turn is regenerated (its text in the file is never used),
and a conversation that ends on a user turn gets one answer more. Turn ``k``
of every conversation of a batch is generated in one left-padded
``generate`` call; the prompt of turn ``k`` is the template applied to the
conversation so far with the *regenerated* earlier answers.

Output: token-id records (:mod:`dflash.training.records`)::

    {"input_ids": [...], "loss_mask": [...], "source": LINE, "turn": K}

``loss_mask`` is 1 exactly on the tokens the target generated (its answer and
its end-of-turn token), 0 on everything the template or the user wrote. Turns
are appended to one record while the template renders the earlier turns as
the very tokens already in it (``ids_so_far`` a prefix of the next prompt);
when it does not (e.g. a template that drops earlier reasoning) a new record
starts at that turn, so every supervised token sits after exactly the context
the target saw when it wrote it.

Resumable: records are appended batch by batch with the conversation's line
as ``source``; ``--resume`` skips the lines already there (a torn last line
is cut off first).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from .records import DataError

__all__ = [
    "Conversation",
    "read_conversations",
    "prompt_ids",
    "regenerate_batch",
    "completed_sources",
    "regenerate_file",
]

_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                 "bot": "assistant", "model": "assistant", "system": "system"}


@dataclass
class Conversation:
    """One conversation: its messages (``role``, ``content``) and its line in the input file."""

    messages: List[dict]
    line: int
    answers: List[List[int]] = field(default_factory=list)  # generated ids, one per assistant slot

    def slots(self) -> List[int]:
        """Indices of the assistant messages to regenerate (plus ``len(messages)`` after a final user turn)."""
        out = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        if self.messages and self.messages[-1]["role"] == "user":
            out.append(len(self.messages))
        return out


def _messages(path, lineno: int, record) -> List[dict]:
    if not isinstance(record, dict) or not ({"messages", "conversations"} & set(record)):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{path} line {lineno}: expected an object with 'messages' (role/content) or "
                        f"'conversations' (from/value), got {keys}")
    raw = record.get("messages", record.get("conversations"))
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{path} line {lineno}: the conversation must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise DataError(f"{path} line {lineno}: message {i} is not an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in _ROLE_ALIASES:
            raise DataError(f"{path} line {lineno}: message {i} has role {role!r}; allowed: "
                            f"{', '.join(sorted(_ROLE_ALIASES))}")
        if not isinstance(content, str):
            raise DataError(f"{path} line {lineno}: message {i} has no text content (a string)")
        out.append({"role": _ROLE_ALIASES[role], "content": content})
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{path} line {lineno}: the conversation has no user turn")
    return out


def read_conversations(path: Union[str, Path]) -> List[Conversation]:
    """Conversations from a JSONL file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"conversation file {path} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            out.append(Conversation(_messages(path, lineno, record), lineno))
    if not out:
        raise DataError(f"conversation file {path} is empty: no conversations")
    return out


def prompt_ids(tokenizer, messages: Sequence[dict], thinking: Optional[bool]) -> List[int]:
    """Token ids of ``messages`` through the chat template, ending in the assistant's generation prompt."""
    kw = {} if thinking is None else {"enable_thinking": bool(thinking)}
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **kw)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _cut(row: List[int], stop: Set[int]) -> List[int]:
    for i, t in enumerate(row):
        if t in stop:
            return row[:i + 1]
    return row


@torch.no_grad()
def _generate(target, prompts: List[List[int]], pad_id: int, stop: Set[int], max_new_tokens: int,
              temperature: float) -> List[List[int]]:
    """Left-padded batched generation: ``[n, P]`` -> each row's new ids, cut after its first stop id."""
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    out = target.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(stop), pad_token_id=pad_id, top_k=None, top_p=None, **kw)
    return [_cut(row, stop) for row in out[:, width:].tolist()]


def _decode(tokenizer, ids: List[int], stop: Set[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in stop], skip_special_tokens=True)


def regenerate_batch(target, tokenizer, conversations: Sequence[Conversation], *, thinking: Optional[bool],
                     max_new_tokens: int, stop_ids: Iterable[int], pad_id: int, temperature: float = 0.0,
                     min_new_tokens: int = 16) -> List[dict]:
    """Regenerate every assistant slot of ``conversations`` (turn by turn, batched) and build their records.

    Returns the records of all conversations (see the module docstring);
    turns whose answer has fewer than ``min_new_tokens`` ids are not
    supervised (they still enter later turns' context).
    """
    stop = {int(t) for t in stop_ids}
    slots = [c.slots() for c in conversations]
    histories = [[] for _ in conversations]  # messages so far, assistant texts regenerated
    turns = [[] for _ in conversations]  # (prompt ids, answer ids) per slot
    for k in range(max((len(s) for s in slots), default=0)):
        active = [i for i, s in enumerate(slots) if k < len(s)]
        prompts = []
        for i in active:
            conv, start = conversations[i], (slots[i][k - 1] + 1 if k else 0)
            histories[i].extend(m for m in conv.messages[start:slots[i][k]] if m["role"] != "assistant")
            prompts.append(prompt_ids(tokenizer, histories[i], thinking))
        answers = _generate(target, prompts, pad_id, stop, max_new_tokens, temperature)
        for i, p, a in zip(active, prompts, answers):
            turns[i].append((p, a))
            conversations[i].answers.append(a)
            histories[i].append({"role": "assistant", "content": _decode(tokenizer, a, stop)})
    records = []
    for conv, conv_turns in zip(conversations, turns):
        records.extend(_records(conv.line, conv_turns, min_new_tokens))
    return records


def _records(line: int, turns: Sequence[Tuple[List[int], List[int]]], min_new_tokens: int) -> List[dict]:
    """Chain turns into records while each prompt extends the ids so far (module docstring)."""
    out: List[dict] = []
    ids: List[int] = []
    mask: List[int] = []
    first = 0

    def flush():
        if sum(mask) >= min_new_tokens:
            out.append({"input_ids": list(ids), "loss_mask": list(mask), "source": line, "turn": first})

    for k, (prompt, answer) in enumerate(turns):
        if ids and prompt[:len(ids)] != ids:
            flush()
            ids, mask, first = [], [], k
        supervised = 1 if len(answer) >= min_new_tokens else 0
        mask += [0] * (len(prompt) - len(ids)) + [supervised] * len(answer)
        ids = list(prompt) + list(answer)
    flush()
    return out


def completed_sources(path: Union[str, Path]) -> Set[int]:
    """Input lines already regenerated into ``path`` (and its ``.progress`` file); a torn last line is cut off."""
    path = Path(path)
    done: Set[int] = set()
    if path.is_file():
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):  # an interrupted write: drop the partial record
            with open(path, "r+b") as f:
                f.truncate(keep)
        for lineno, line in enumerate(data[:keep].decode("utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    done.add(int(json.loads(line)["source"]))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    raise DataError(f"{path} line {lineno}: not a record of this tool (no 'source'); "
                                    "cannot resume into it") from None
    progress = Path(str(path) + ".progress")
    if progress.is_file():
        for line in progress.read_text().splitlines():
            if line.strip():
                try:
                    done.update(int(x) for x in json.loads(line)["done"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # a torn progress line: those conversations run again
    return done


def regenerate_file(target, tokenizer, conversations_path, out_path, *, thinking: Optional[bool],
                    max_new_tokens: int = 2048, batch_size: int = 16, temperature: float = 0.0, seed: int = 0,
                    min_new_tokens: int = 16, resume: bool = False, limit: Optional[int] = None,
                    progress: bool = True) -> dict:
    """Regenerate a conversation file into ``out_path``; returns counts (conversations, records, tokens).

    Without ``resume`` an existing ``out_path`` is refused. ``limit``: stop
    after that many conversations of the file (for a first look).
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"need --batch-size >= 1 and --max-new-tokens >= 1, got {batch_size}, {max_new_tokens}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template: regenerating conversations needs one "
                        "(give --tokenizer DIR of the target's chat tokenizer)")
    if thinking is None and "enable_thinking" in tokenizer.chat_template:
        raise DataError("the chat template has a thinking mode: choose it with --thinking or --no-thinking "
                        "(the mode the drafter will serve)")
    out_path, progress_path = Path(out_path), Path(str(out_path) + ".progress")
    if out_path.exists() and not resume:
        raise DataError(f"{out_path} exists: give --resume to continue it, or remove it")
    conversations = read_conversations(conversations_path)
    if limit is not None:
        conversations = conversations[:limit]
    done = completed_sources(out_path) if resume else set()
    todo = [c for c in conversations if c.line not in done]
    stop = _stop_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="regenerating",
                   unit="conv", dynamic_ncols=True)
    n_records = n_tokens = n_supervised = 0
    with open(out_path, "a", encoding="utf-8") as out, open(progress_path, "a", encoding="utf-8") as prog:
        for b0 in range(0, len(todo), batch_size):
            batch = todo[b0:b0 + batch_size]
            if temperature > 0:
                torch.manual_seed(seed * 1_000_003 + batch[0].line)
            records = regenerate_batch(target, tokenizer, batch, thinking=thinking, max_new_tokens=max_new_tokens,
                                       stop_ids=stop, pad_id=pad_id, temperature=temperature,
                                       min_new_tokens=min_new_tokens)
            out.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
            out.flush()
            os.fsync(out.fileno())
            prog.write(json.dumps({"done": [c.line for c in batch]}) + "\n")
            prog.flush()
            n_records += len(records)
            n_tokens += sum(len(r["input_ids"]) for r in records)
            n_supervised += sum(sum(r["loss_mask"]) for r in records)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(records=n_records, tokens=n_tokens, refresh=False)
    if bar is not None:
        bar.close()
    return dict(conversations=len(conversations), regenerated=len(todo), skipped=len(conversations) - len(todo),
                records=n_records, tokens=n_tokens, supervised_tokens=n_supervised)


def _stop_ids(target, tokenizer) -> Set[int]:
    """End-of-turn ids: the target's generation config's ``eos_token_id`` (an int or a list), else the tokenizer's."""
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("neither the target's generation config nor the tokenizer has an end-of-turn "
                        "(eos) token: generation would never stop")
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
