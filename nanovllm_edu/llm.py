# header
__all__ = ['EngineRunner', 'LLM']

from .engine.async_scheduling import AsyncLLMEngine, AsyncRunnerMixin
from .engine.cuda_graph import CUDAGraphMixin
from .engine.model_runner import ModelRunner
from .engine.tp_worker import TensorParallelMixin


class EngineRunner(TensorParallelMixin, CUDAGraphMixin, AsyncRunnerMixin, ModelRunner):
    """The model runner `LLM` uses: notebook 08's ModelRunner with async inputs (10), CUDA graphs for decode
    (11) and tensor parallelism (12). Each part stands aside when its engine argument turns it off."""


class LLM(AsyncLLMEngine):
    """`LLM(model_path, **engine_args).generate(prompts, sampling_params)`: the public entry point, with
    every part of the course: async scheduling, CUDA graphs, tensor parallelism."""
    runner_class = EngineRunner
