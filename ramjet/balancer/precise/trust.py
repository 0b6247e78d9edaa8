"""One replica's standing in precise mode: is it routed on its engine's reports, or on the approximate index?

The rules (precise/mode.py's docstring tells when each applies): a replica is trusted
while its stream is complete from its start (`synced`), its predictions agree with
what its engine reports (`agreeing`), and no batch it owes is late (`awaited`).
Pure state: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AGREE_WINDOW = 3      # answers in a row that decide distrust, and trust again
LOST = {"partial": "partial", "shed": "shedding", "overflow": "overflow"}  # stream kind -> reason: lost batches


@dataclass(slots=True)
class Trust:
    """One replica's standing: does the router use the engine's report, or the approximate index?"""

    synced: bool = False           # the stream's start is known (replay reached back, or a restart)
    agreeing: bool = True          # predictions matched the engine's cached tokens lately
    reason: str = "starting"       # why it is not trusted, when it is not
    streak: list = field(default_factory=list)  # the last AGREE_WINDOW comparisons (True: within a block)
    awaited: float | None = None   # a batch is owed by then: the engine answered a request that stored blocks

    def trusted(self, now: float) -> bool:
        if self.awaited is not None and now > self.awaited:  # silent while it should have spoken
            self.reason = "silent"
            return False
        return self.synced and self.agreeing

    @property
    def lost(self) -> bool:
        """Batches were lost for good (partial, shed, overflow): only agreeing predictions bring trust back."""
        return self.reason in LOST.values()

    def stream(self, kind: str) -> None:
        """A StreamState from the subscriber: live | gap | partial | restart | disconnected | silent (an idle
        engine is silent, which is fine) | shed; or overflow (the view grew past its bound), failed (the stream
        could not open)."""
        if kind in LOST:
            self.synced, self.reason = False, LOST[kind]
        elif kind in ("disconnected", "failed"):  # failed: our socket to it could not open
            self.synced, self.reason, self.streak, self.awaited = False, kind, [], None
        elif kind == "restart":
            self.synced, self.agreeing, self.streak, self.awaited = True, True, [], None

    def batch(self) -> None:
        self.awaited = None

    def owed(self, deadline: float) -> None:
        """An answer that must have stored blocks: a batch should arrive before `deadline`."""
        if self.awaited is None:
            self.awaited = deadline

    def synced_from_start(self) -> None:
        self.synced = True

    def compare(self, agreed: bool) -> None:
        """One answered request: did the prediction land within a block of what the engine reported?"""
        self.streak = (self.streak + [agreed])[-AGREE_WINDOW:]
        if len(self.streak) == AGREE_WINDOW and not any(self.streak):
            self.agreeing, self.reason = False, "disagrees"
        elif len(self.streak) == AGREE_WINDOW and all(self.streak):
            self.agreeing = True
            if not self.synced:  # a partial stream earns trust back by agreeing
                self.synced = True
