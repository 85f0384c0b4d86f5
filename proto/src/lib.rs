//! lockstep-proto
