//! lockstep-routing: the workers a pair may run on. Worker pools with their members, health and
//! pick policies, the prefix index and the engines' KV events ([`pool`]), and the Kubernetes
//! discovery that turns pods into members ([`discovery`]).

pub mod discovery;
#[doc(hidden)]
pub mod fuzzing;
pub mod pool;
