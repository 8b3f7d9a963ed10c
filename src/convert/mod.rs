//! Disk conversion (qemu-img, virt-v2v when present), artifact validation and
//! the staging HTTP server that CDI imports from.
