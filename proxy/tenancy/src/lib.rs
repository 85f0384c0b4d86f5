//! lockstep-tenancy: who is calling and what they may spend. API keys name tenants
//! ([`tenant`]), each with its models, request rate, concurrency and token budget
//! ([`budget`]); with `[shared]` those limits hold across replicas through Redis ([`shared`]).

pub mod budget;
pub mod shared;
pub mod tenant;
