"""llama-server's slot actions (save, restore, erase) as tasks the engine thread runs between steps once their slot
is idle (a busy slot's action waits for its request to end, as llama-server defers it); the file itself is written
or read on the caller's thread (slot_files.py)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from . import slot_files
from .client import SlotFileResult
from .errors import EngineError, InvalidRequest, ServerError
from .reuse import PrefixReuse
from .slots import Slot, Slots

Task = tuple[int, Callable[[Slot], Any], "Future[Any]"]
# runs an action's work on its slot with what else must happen with it (tensor parallelism's other ranks)
Around = Callable[[Slot, Callable[[Slot], Any]], Any]


class SlotTasks:
    """The queue of slot actions: callers `act` from any thread; the engine thread `take`s the ready ones and
    `run`s them."""

    def __init__(self, wake: threading.Condition, n_slots: int, model_path: str | None) -> None:
        self._wake, self.n_slots, self.model_path = wake, n_slots, model_path
        self._tasks: deque[Task] = deque()
        self.running = True

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def act(
        self,
        id_slot: int,
        action: str,
        path: Path | None,
        reuse: PrefixReuse,
        hidden: Any,
        around: Around | None = None,
    ) -> SlotFileResult:
        """Save the slot to `path`, restore it from `path`, or erase it (`reuse.forget`); file errors are
        InvalidRequest (400). `around(slot, work)` runs the work on the engine thread instead of `work(slot)`."""

        def on_slot(work: Callable[[Slot], Any]) -> Any:
            return self._on_slot(id_slot, work if around is None else lambda slot: around(slot, work))

        if not 0 <= id_slot < self.n_slots:
            raise InvalidRequest("Invalid slot ID")
        slots, drafter = reuse.slots, reuse.drafter
        t_start = time.perf_counter()
        if action == "erase":
            return SlotFileResult(on_slot(lambda slot: _erase(slot, reuse)))
        if action not in ("save", "restore"):
            raise InvalidRequest("Invalid action")
        if path is None:
            raise InvalidRequest(f"{action}: a file is required")
        if self.model_path is None:
            raise ServerError("slot files need the model's path (Engine(model_path=...)) for its fingerprint")
        fingerprint = slot_files.model_fingerprint(self.model_path)
        if action == "save":
            image = on_slot(lambda slot: slot_files.capture(slot, drafter))
            n_bytes = slot_files.write(path, image, fingerprint)
        else:
            image, n_bytes = slot_files.read(path, fingerprint)
            on_slot(lambda slot: slot_files.apply(image, slot, slots, drafter, hidden))
        return SlotFileResult(image.n_tokens, n_bytes, 1000.0 * (time.perf_counter() - t_start))

    def _on_slot(self, id_slot: int, task: Callable[[Slot], Any]) -> Any:
        """Run `task(slot)` on the engine thread once the slot is idle; its result (or its error, raised here)."""
        future: Future[Any] = Future()
        with self._wake:
            if not self.running:
                raise ServerError("the server is shutting down")
            self._tasks.append((id_slot, task, future))
            self._wake.notify()
        try:
            return future.result()
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug or a device failure: a 500 that names it
            raise ServerError(f"{type(e).__name__}: {e}") from e

    def take(self, slots: Slots) -> list[Task]:
        """The queued actions whose slot is idle (the others wait for their request to end); under the lock."""
        ready = [t for t in self._tasks if slots[t[0]].job is None]
        for task in ready:
            self._tasks.remove(task)
        return ready

    @staticmethod
    def run(tasks: list[Task], slots: Slots) -> None:
        for id_slot, task, future in tasks:
            try:
                future.set_result(task(slots[id_slot]))
            except Exception as e:  # noqa: BLE001 - handed to the caller waiting on it
                future.set_exception(e)

    def fail_all(self) -> None:
        """The engine stopped: every waiting caller hears so (under the lock)."""
        for _, _, future in self._tasks:
            future.set_exception(ServerError("the server is shutting down"))
        self._tasks.clear()


def _erase(slot: Slot, reuse: PrefixReuse) -> int:
    n_erased = len(slot.tokens)
    reuse.forget(slot)
    return n_erased
