# The vmmigrate image: `vmmigrate run` (deploy/base) and the conversion Jobs
# (`vmmigrate convert`, runner `job`) use the same image.
#
# NOT BUILT HERE: the development machine has no Docker engine, so this file
# has never been built; treat its first build as a test of it.
#   docker build -t registry.example.net/platform/vmmigrate:0.1.0 .

FROM rust:1-bookworm AS build
WORKDIR /src
# Only what the build reads; Cargo.lock pins every dependency (--locked).
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo.toml declares the benches; cargo wants their files to exist.
COPY benches ./benches
RUN cargo build --release --locked --bin vmmigrate \
 && install -m 0755 target/release/vmmigrate /vmmigrate

FROM debian:bookworm-slim
# qemu-utils: qemu-img (conversion, artifact checks); git and openssh-client:
# the status branch is pushed with the git CLI, ssh:// repositories;
# ca-certificates: HTTPS to forges and repositories.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      qemu-utils git openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /vmmigrate /usr/local/bin/vmmigrate
# Non-root, numeric so runAsNonRoot can verify it. ssh refuses to run for a
# uid without a passwd entry, hence the user; its home is /tmp, like $HOME in
# the Deployment (the root filesystem is read-only there, /tmp an emptyDir).
# The work directory and the Git cache are volumes in the Deployment; these
# directories only make the image usable on its own.
RUN groupadd --gid 65532 vmmigrate \
 && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin vmmigrate \
 && install -d -o 65532 -g 65532 /var/lib/vmmigrate /var/cache/vmmigrate
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/vmmigrate"]
