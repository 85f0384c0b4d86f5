# lockstep's image: built with the same `cargo build --release --locked` CI runs, served from a
# minimal non-root runtime image. No model is baked in: a remote-backend configuration needs only
# the tokenizer and chat template (mounted, see deploy/kubernetes); the embedded engine's model is
# mounted too (the runtime image has no pip to fetch one).
#
#   docker build -t lockstep .
#   docker run --rm -p 8080:8080 -v "$PWD/config:/etc/lockstep:ro" lockstep serve --config /etc/lockstep/lockstep.toml

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p lockstep \
    && install -D -m 0755 target/release/lockstep /out/lockstep

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/lockstep /usr/local/bin/lockstep
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/lockstep"]
CMD ["serve", "--config", "/etc/lockstep/lockstep.toml"]
