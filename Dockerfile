# The vmmigrate image: `vmmigrate run` (deploy/base) and the conversion Jobs
# (`vmmigrate convert`, runner `job`) use the same image.
#
# NOT BUILT HERE: the development machine has no Docker engine, so this file
# has never been built; treat its first build as a test of it.
#   docker build --build-arg VERSION=0.1.0 -t registry.example.net/platform/vmmigrate:0.1.0 .
# tools/image/build.sh builds the same image (same packages, user, directories,
# config) without Docker, from a release binary and Debian packages; CI runs it
# and tools/image/check.sh. Keep the two in step.

FROM rust:1-bookworm AS build
WORKDIR /src
# The whole workspace (members such as tools/harness, declared benches and
# tests); .dockerignore keeps target/, .git and the rest out. Cargo.lock pins
# every dependency (--locked); no default features leaves the demo harness out.
COPY . .
RUN cargo build --release --locked --no-default-features --bin vmmigrate \
 && install -m 0755 target/release/vmmigrate /vmmigrate

FROM debian:bookworm-slim
ARG VERSION=0.1.0
# qemu-utils: qemu-img (conversion, artifact checks); git and openssh-client:
# the status branch is pushed with the git CLI, ssh:// repositories;
# ca-certificates: HTTPS to forges and repositories; virt-v2v, guestfish,
# nbdkit, libnbd-bin, a kernel and ovmf: whole-guest conversion (libguestfs's
# appliance is built from the image at first use; virt-v2v names OVMF's
# files in a UEFI guest's output). /var/tmp is /tmp: QEMU
# puts the appliance's overlay there and the root is read-only.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates git openssh-client qemu-utils \
      virt-v2v guestfish nbdkit libnbd-bin linux-image-cloud-amd64 ovmf \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/*.log /var/log/apt/* \
 && rm -rf /var/tmp && ln -s /tmp /var/tmp
COPY --from=build /vmmigrate /usr/local/bin/vmmigrate
# Non-root, numeric so runAsNonRoot can verify it. ssh refuses to run for a
# uid without a passwd entry, hence the user; its home is /tmp, like $HOME in
# the Deployment (the root filesystem is read-only there, /tmp an emptyDir).
# The work directory and the Git cache are volumes in the Deployment; these
# directories only make the image usable on its own.
RUN groupadd --gid 65532 vmmigrate \
 && useradd --uid 65532 --gid 65532 --comment vmmigrate --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin vmmigrate \
 && install -d -m 0755 -o 65532 -g 65532 /var/lib/vmmigrate /var/cache/vmmigrate
ENV HOME=/tmp
LABEL org.opencontainers.image.title=vmmigrate \
      org.opencontainers.image.version=$VERSION \
      org.opencontainers.image.source=https://git.example.net/platform/vmmigrate \
      org.opencontainers.image.licenses=Apache-2.0
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/vmmigrate"]
