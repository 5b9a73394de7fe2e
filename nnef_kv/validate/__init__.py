"""Validation of quantized-KV archives: archive round trip, tract parity, numeric cost vs an f32 reference,
and the report files (see :mod:`.runner` for exactly what is measured)."""
from __future__ import annotations

from .decode import DecodeSignature, DecodeTrace, InterpreterDecoder, TractDecoder, detect_signature, run_decode
from .metrics import kl_divergence, rel_l2, summary_stats
from .report import REPORT_FILES, write_report
from .roundtrip import RoundTripResult, check_round_trip
from .runner import (
    Check,
    NumericCost,
    ParityResult,
    ValidateOptions,
    ValidationReport,
    default_prompt,
    numeric_cost,
    reference_trace,
    tract_parity,
    validate_model,
)

__all__ = ["DecodeSignature", "DecodeTrace", "InterpreterDecoder", "TractDecoder", "detect_signature", "run_decode",
           "kl_divergence", "rel_l2", "summary_stats", "REPORT_FILES", "write_report", "RoundTripResult",
           "check_round_trip", "Check", "NumericCost", "ParityResult", "ValidateOptions", "ValidationReport",
           "default_prompt", "numeric_cost", "reference_trace", "tract_parity", "validate_model"]
