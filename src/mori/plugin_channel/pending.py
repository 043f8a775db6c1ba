"""The label operations accepted by the label server and not yet applied by the engine's
scheduler (an idle engine does not step), kept in a form bounded in labels, not in
messages.

Per program, what is pending is at most a drop followed by a label: a ``set`` after a
``drop`` labels the program anew, a ``drop`` after a ``set`` forgets the label, and only
the last label counts. A ``replace`` or ``clear`` is a *reset*: the labels pending before
it are superseded, and the ``set`` labels after it merge into it. Operations on different
programs do not depend on each other's order (a drop evicts blocks that no other program
uses, whatever its label). So everything pending is:

- the drops, in the order first sent (each program once);
- the reset, if one came: the table to start from;
- the labels set since (merged into the reset when there is one);

and :meth:`PendingLabels.drain` hands them to the scheduler in that order: drops, then the
reset, then one ``set``. Applying them gives what applying every message in turn would.

Bounds: at most ``max_labels`` labels (in the reset and the set together) and at most
``max_labels`` drops. Beyond, the least recently set label is forgotten, which is what the
engine's label table (``labels.LabelTable``, ``MAX_PROGRAMS``, least recently set first)
would do when applying them, when ``max_labels`` is not above its size; and the oldest
drop is forgotten (its program keeps its label and its KV is evicted in its turn rather than
at once). Repeated messages about the same programs take no more room: 600 ``set``
messages of 1,000 new ids each leave ``max_labels`` labels pending, not 600,000.
"""

from __future__ import annotations

from collections import OrderedDict

from .protocol import Message


class PendingLabels:
    """What the scheduler has yet to apply (not thread-safe: the server holds a lock)."""

    def __init__(self, max_labels: int) -> None:
        if max_labels < 1:
            raise ValueError(f"max_labels must be >= 1, got {max_labels}")
        self.max_labels = max_labels
        self._drops: OrderedDict[str, None] = OrderedDict()
        self._reset: bool = False
        self._labels: OrderedDict[str, str] = OrderedDict()
        self.forgotten_labels = 0  # labels pushed out by newer ones (since the start)
        self.forgotten_drops = 0

    def __len__(self) -> int:
        """Labels and drops pending."""
        return len(self._labels) + len(self._drops)

    def __bool__(self) -> bool:
        return bool(self._drops or self._reset or self._labels)

    def add(self, msg: Message) -> int:
        """Take one operation; how many pending entries it pushed out (0 within bounds)."""
        if msg.op in ("replace", "clear"):
            self._reset = True
            self._labels = OrderedDict()
            self._set(msg.labels or {})
        elif msg.op == "set":
            self._set(msg.labels or {})
        elif msg.op == "drop" and msg.program is not None:
            self._labels.pop(msg.program, None)
            self._drops[msg.program] = None
        else:
            raise ValueError(f"not a label operation: {msg.op!r}")
        return self._bound()

    def _set(self, labels: dict[str, str]) -> None:
        for program, label in labels.items():
            self._labels[program] = label
            self._labels.move_to_end(program)

    def _bound(self) -> int:
        out = 0
        while len(self._labels) > self.max_labels:
            self._labels.popitem(last=False)
            self.forgotten_labels += 1
            out += 1
        while len(self._drops) > self.max_labels:
            self._drops.popitem(last=False)
            self.forgotten_drops += 1
            out += 1
        return out

    def messages(self) -> list[Message]:
        """What is pending as operations, in the order to apply them."""
        out = [Message("drop", program=p) for p in self._drops]
        if self._reset:
            out.append(Message("replace", labels=dict(self._labels)) if self._labels
                       else Message("clear"))
        elif self._labels:
            out.append(Message("set", labels=dict(self._labels)))
        return out

    def drain(self) -> list[Message]:
        """:meth:`messages`, and forget them."""
        out = self.messages()
        self._drops = OrderedDict()
        self._reset = False
        self._labels = OrderedDict()
        return out
