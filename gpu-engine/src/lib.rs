//! lockstep-engine
