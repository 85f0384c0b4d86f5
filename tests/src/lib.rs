//! lockstep-tests
