//! lockstep-proto: the gRPC API (`lockstep.v1`) and worker API. Not built yet: this crate only
//! reserves its place in the workspace; see the gRPC issue.
