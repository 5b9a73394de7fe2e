"""Validation of quantized-KV archives on real text: teacher-forced predictions at the context lengths
that matter, against the f32 reference (KL, top-1, perplexity, attention deviation, quantized-token
counts, KV bytes), plus the archive round trip and tract parity; report files (see :mod:`.runner`)."""
from __future__ import annotations

import sys
import types
from typing import Any

from .decode import DecodeSignature, DecodeTrace, InterpreterDecoder, TractDecoder, detect_signature, run_decode
from .metrics import kl_divergence, mean_stderr, rel_l2, summary_stats, token_measures
from .report import REPORT_FILES, write_report
from .roundtrip import RoundTripResult, check_round_trip
from .api import validate
from .runner import (
    Check,
    ContextResult,
    Measurement,
    ParityResult,
    ValidateOptions,
    ValidationReport,
    check_same_model,
    max_positions,
    resolve_contexts,
    validate_model,
    vocab_size,
)

__all__ = ["DecodeSignature", "DecodeTrace", "InterpreterDecoder", "TractDecoder", "detect_signature", "run_decode",
           "kl_divergence", "mean_stderr", "rel_l2", "summary_stats", "token_measures", "REPORT_FILES", "write_report",
           "RoundTripResult", "check_round_trip", "Check", "ContextResult", "Measurement", "ParityResult",
           "ValidateOptions", "ValidationReport", "check_same_model", "max_positions", "resolve_contexts",
           "validate_model", "vocab_size", "validate"]


class _CallableModule(types.ModuleType):
    """``nnef_kv.validate(...)`` is :func:`.api.validate`; the package stays importable as before."""

    def __call__(self, *args: Any, **kwargs: Any) -> ValidationReport:
        return validate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
