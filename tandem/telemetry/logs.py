"""One log format for all services, so the interleaved output of ``tandem serve`` stays readable."""

from __future__ import annotations

import logging
import os
import warnings


def setup_logging(service: str, level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service:<7} %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # Loading libraries are chatty (progress bars, advisory warnings); keep their errors only.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", category=FutureWarning)
    for noisy in ("httpx", "httpcore", "urllib3", "grpc._cython"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
