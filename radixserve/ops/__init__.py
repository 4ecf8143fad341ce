"""Operator tools: capacity planning (``plan``), a live view with saturation signals (``top``),
and the day in review from a metrics log (``report``)."""
