# header
__all__ = ['STEP_PARTS', 'StepObserver', 'ObserverGroup']

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

STEP_PARTS = ("schedule", "prepare", "forward", "sample", "postprocess")  # what the engine reports, in order
_NOTHING = nullcontext()


class StepObserver:
    """Watches an engine's steps; this base class watches nothing. The engine calls `step_started`, then
    `part(name)` around each part of the step (STEP_PARTS; the model runner reports prepare, forward and
    sample), `step_scheduled` once the batch is known and `step_finished` at the end. Attach one with
    `engine.observe(observer)` (observers attached inside one another's blocks all watch); while any is
    attached the engine runs one step at a time."""

    def part(self, name: str) -> AbstractContextManager:
        return _NOTHING

    def step_started(self, engine) -> None:
        pass

    def step_scheduled(self, engine, seqs: list, is_prefill: bool) -> None:
        pass

    def step_finished(self, engine, seqs: list, is_prefill: bool, finished: list) -> None:
        pass


class ObserverGroup(StepObserver):
    """Several observers of one engine (a trace and a timer, say), each told everything, in attach order."""

    def __init__(self, observers: list[StepObserver]):
        self.observers = list(observers)

    @contextmanager
    def part(self, name: str):
        with ExitStack() as stack:
            for observer in self.observers:
                stack.enter_context(observer.part(name))
            yield

    def step_started(self, engine) -> None:
        for observer in self.observers:
            observer.step_started(engine)

    def step_scheduled(self, engine, seqs: list, is_prefill: bool) -> None:
        for observer in self.observers:
            observer.step_scheduled(engine, seqs, is_prefill)

    def step_finished(self, engine, seqs: list, is_prefill: bool, finished: list) -> None:
        for observer in self.observers:
            observer.step_finished(engine, seqs, is_prefill, finished)
