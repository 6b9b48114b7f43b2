from pagedlm.core.executor.abstract import Executor

__all__ = ["Executor"]
