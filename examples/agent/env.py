"""Airline-style tool environment: an in-memory database, four tools, seeded tasks with a scripted
user and an exact checker on the final database state.

Tools (an agent turn ``call name(arg,arg)``):

* ``get_booking(B)`` → flight, status, paid amount, refundable flag;
* ``search_flights(ORIG,DEST,dN)`` → flights on that route and day with prices;
* ``change_flight(B,F)`` → moves an active booking to flight F of the same route (fare difference charged);
* ``cancel_booking(B)`` → cancels; refunds the paid amount if the booking is refundable, else 0.

Task kinds: ``change`` (move booking B to day d on the same route: the cheapest such flight),
``cancel`` (cancel B; the refund must equal its refundable amount), ``lookup`` (tell the user the
flight of B in a ``say`` turn; the database must be unchanged).
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass, field

__all__ = ["AirlineDB", "Task", "make_tasks", "run_tool", "check_task", "user_reply", "CALL_RE"]

CITIES = ("SFO", "JFK", "LAX", "SEA", "BOS", "ORD")
CALL_RE = re.compile(r"^call (\w+)\(([^)]*)\)$")


@dataclass
class AirlineDB:
    """Flights ``F<n>``: (origin, dest, day, price); bookings ``B<n>``: flight, status, paid, refundable."""

    flights: dict[str, tuple[str, str, int, int]] = field(default_factory=dict)
    bookings: dict[str, dict] = field(default_factory=dict)
    refunds: list[tuple[str, int]] = field(default_factory=list)

    def copy(self) -> AirlineDB:
        return copy.deepcopy(self)


def run_tool(db: AirlineDB, name: str, args: list[str]) -> str:
    """Execute one tool call on ``db`` (mutated in place); returns the tool's text result."""
    def booking(b):
        if b not in db.bookings:
            raise KeyError(f"no booking {b}")
        return db.bookings[b]

    try:
        if name == "get_booking" and len(args) == 1:
            bk = booking(args[0])
            return (f"{args[0]}: flight {bk['flight']} status {bk['status']} paid {bk['paid']} "
                    f"refundable {'yes' if bk['refundable'] else 'no'}")
        if name == "search_flights" and len(args) == 3:
            o, d, day = args[0], args[1], int(args[2].lstrip("d"))
            hits = [f"{f} price {p}" for f, (fo, fd, fday, p) in sorted(db.flights.items())
                    if (fo, fd, fday) == (o, d, day)]
            return "; ".join(hits) if hits else "no flights"
        if name == "change_flight" and len(args) == 2:
            bk = booking(args[0])
            if args[1] not in db.flights:
                return f"error: no flight {args[1]}"
            if bk["status"] != "active":
                return f"error: {args[0]} is {bk['status']}"
            old, new = db.flights[bk["flight"]], db.flights[args[1]]
            if old[:2] != new[:2]:
                return "error: route differs"
            diff = new[3] - old[3]
            bk["flight"], bk["paid"] = args[1], bk["paid"] + max(diff, 0)
            return f"ok: {args[0]} now on {args[1]}, charged {max(diff, 0)}"
        if name == "cancel_booking" and len(args) == 1:
            bk = booking(args[0])
            if bk["status"] != "active":
                return f"error: {args[0]} is {bk['status']}"
            bk["status"] = "cancelled"
            amount = bk["paid"] if bk["refundable"] else 0
            db.refunds.append((args[0], amount))
            return f"ok: {args[0]} cancelled, refund {amount}"
    except (KeyError, ValueError) as exc:
        return f"error: {exc.args[0] if exc.args else exc}"
    return f"error: unknown call {name}({','.join(args)})"


@dataclass
class Task:
    """One user goal over its own database."""

    id: str
    kind: str
    """``change``, ``cancel`` or ``lookup``."""
    booking: str
    db: AirlineDB
    day: int = 0
    """Target day (``change``)."""
    request: str = ""
    """The user's first message."""

    def target_flight(self) -> str | None:
        """The cheapest flight on the booking's route and the target day (``change``)."""
        o, d, _, _ = self.db.flights[self.db.bookings[self.booking]["flight"]]
        hits = sorted((p, f) for f, (fo, fd, day, p) in self.db.flights.items() if (fo, fd, day) == (o, d, self.day))
        return hits[0][1] if hits else None


def make_tasks(n: int, *, seed: int = 0, kinds: tuple[str, ...] = ("change", "cancel", "lookup")) -> list[Task]:
    """``n`` tasks cycling through ``kinds``, each with a small random database (seeded)."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        db = AirlineDB()
        fid = 0
        for o in CITIES[:3]:
            for d in CITIES[3:]:
                for day in range(1, 4):
                    for _ in range(2):
                        db.flights[f"F{fid}"] = (o, d, day, rng.randrange(100, 500, 10))
                        fid += 1
        for b in range(3):
            f = rng.choice(sorted(db.flights))
            db.bookings[f"B{b}"] = {"flight": f, "status": "active", "paid": db.flights[f][3],
                                    "refundable": rng.random() < 0.5}
        kind = kinds[i % len(kinds)]
        bk = f"B{rng.randrange(3)}"
        day = rng.choice([d for d in (1, 2, 3) if d != db.flights[db.bookings[bk]["flight"]][2]])
        request = {"change": f"please change my booking {bk} to day {day}",
                   "cancel": f"please cancel my booking {bk}",
                   "lookup": f"what flight is my booking {bk} on?"}[kind]
        tasks.append(Task(id=f"task{seed}-{i}", kind=kind, booking=bk, db=db, day=day, request=request))
    return tasks


def user_reply(task: Task, agent_text: str) -> str | None:
    """The scripted user's answer to an agent ``say`` turn; ``None`` ends the episode."""
    if "confirm" in agent_text:
        return "yes, I confirm"
    if "done" in agent_text or "flight F" in agent_text:
        return None
    return f"I want: {task.request}"


def check_task(task: Task, final_db: AirlineDB, agent_says: list[str]) -> float:
    """1.0 iff the final database (and, for ``lookup``, the answer) is exactly the goal's."""
    want = task.db.copy()
    if task.kind == "change":
        target = task.target_flight()
        run_tool(want, "change_flight", [task.booking, target])
    elif task.kind == "cancel":
        run_tool(want, "cancel_booking", [task.booking])
    elif task.kind == "lookup":
        flight = task.db.bookings[task.booking]["flight"]
        if not any(re.search(rf"\bflight {flight}\b", s) for s in agent_says):
            return 0.0
    same = want.bookings == final_db.bookings and want.refunds == final_db.refunds
    return 1.0 if same else 0.0
