//! Decode loop, sampler, request queue and counters.
