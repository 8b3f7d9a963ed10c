//! Real KubeVirt v1.8.0 on the test node, deployed the way KubeVirt deploys
//! itself: its operator, from the manifest KubeVirt's own
//! `manifest-templator` writes with the image names it is given, and a
//! `KubeVirt` resource; the operator then installs virt-api (with its
//! webhooks and subresource API), virt-controller and the virt-handler
//! DaemonSet, whose pods start a virt-launcher pod (libvirt + QEMU) per
//! running VM on the node.
//!
//! Built from KubeVirt's Go module by `tools/testenv/kubevirt.sh`, images by
//! `tools/testenv/kubevirt-images.sh` (handler and launcher on Debian
//! trixie). What differs from an upstream install, and why:
//! - `useEmulation: true`: this machine's `/dev/kvm` is a paravirtual KVM
//!   without VMX/SVM that cannot run a guest, so QEMU runs guests in
//!   software emulation (TCG).
//! - one replica of the operator, virt-api and virt-controller (the node
//!   has two CPUs).
//! - the launcher's libvirt is Debian's monolithic libvirtd behind a
//!   `virtqemud` wrapper, and its OVMF files are linked to the names
//!   KubeVirt looks for (kubevirt-images.sh says more).
//! - one patch to virt-handler, `tools/testenv/kubevirt/*.patch`: software
//!   emulation without /dev/kvm in the launcher's pod.
//!
//! No secondary networks: KubeVirt's bridge binding (what a `multus`
//! network of a VM gets) creates a dummy link in the launcher's pod, and
//! this machine's kernel is built without dummy links (CONFIG_DUMMY unset,
//! no modules). Multus v4.2.3 itself ran here (its thin plugin from its Go
//! module, the NetworkAttachmentDefinition CRD): virt-handler then failed
//! the VM with "LinkAdd: operation not supported".

use crate::KubeEnv;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const VERSION: &str = "v1.8.0";
pub const NAMESPACE: &str = "kubevirt";
pub const REGISTRY: &str = "registry.test.local";

/// The KubeVirt resource the tests run with.
const KUBEVIRT_CR: &str = r#"apiVersion: kubevirt.io/v1
kind: KubeVirt
metadata:
  name: kubevirt
  namespace: kubevirt
spec:
  imagePullPolicy: IfNotPresent
  infra:
    replicas: 1
  configuration:
    developerConfiguration:
      useEmulation: true
"#;

/// KubeVirt's commands and manifest templates (`tools/testenv/kubevirt.sh`).
pub fn build() -> anyhow::Result<PathBuf> {
    crate::setup::packages()?;
    crate::setup::run_build_script("testenv-kubevirt", "tools/testenv/kubevirt.sh", &[])
}

/// The image archives (`tools/testenv/kubevirt-images.sh`).
pub fn images(built: &std::path::Path) -> anyhow::Result<PathBuf> {
    crate::setup::run_build_script(
        "testenv-kubevirt-images",
        "tools/testenv/kubevirt-images.sh",
        &[built, &crate::setup::cache_root().join("testenv-kubevirt-images")],
    )
}

/// The operator's install manifest, written by KubeVirt's templator.
fn operator_manifest(built: &std::path::Path) -> anyhow::Result<String> {
    let share = built.join("share/manifests");
    let out = Command::new(built.join("bin/manifest-templator"))
        .args([
            "--process-vars",
            "--process-files",
            &format!("--namespace={NAMESPACE}"),
            &format!("--container-prefix={REGISTRY}"),
            &format!("--container-tag={VERSION}"),
            "--image-pull-policy=IfNotPresent",
            "--verbosity=2",
            // Only the OLM bundle shows the logo.
            "--kubevirt-logo-path=/dev/null",
        ])
        .arg(format!("--generated-manifests-dir={}", share.join("generated").display()))
        .arg(format!("--input-file={}", share.join("release/kubevirt-operator.yaml.in").display()))
        .stderr(Stdio::inherit())
        .output()?;
    anyhow::ensure!(out.status.success(), "manifest-templator failed");
    // The generated parts are pasted in unexpanded (upstream's release
    // pipeline runs them through the templator first).
    let text = String::from_utf8(out.stdout)?.replace("{{.Namespace}}", NAMESPACE);
    anyhow::ensure!(!text.contains("{{"), "the operator manifest still has template fields");
    // One operator replica on a two-CPU node.
    Ok(text.replacen("\n  replicas: 2\n", "\n  replicas: 1\n", 1))
}

/// Builds (once, cached), imports and deploys KubeVirt; returns when the
/// operator reports KubeVirt `Deployed`.
pub fn install(env: &KubeEnv) -> anyhow::Result<()> {
    let started = Instant::now();
    let built = build()?;
    let images = images(&built)?;
    for entry in std::fs::read_dir(&images)? {
        let path = entry?.path();
        if path.to_string_lossy().ends_with(".oci.tar") {
            env.import_image(&path)?;
        }
    }
    // virt-operator runs on control-plane nodes only; the one node is.
    env.kubectl(&["label", "node", "--all", "--overwrite", "node-role.kubernetes.io/control-plane="])?;
    let dir = tempfile::tempdir()?;
    let operator = dir.path().join("kubevirt-operator.yaml");
    std::fs::write(&operator, operator_manifest(&built)?)?;
    env.kubectl(&["apply", "--server-side", "--force-conflicts", "-f", &operator.to_string_lossy()])?;
    // The API server takes the KubeVirt resource only once its definition
    // is established; applied before that, it is refused ("no matches for
    // kind").
    env.kubectl(&["wait", "--for=condition=Established", "--timeout=60s", "crd/kubevirts.kubevirt.io"])?;
    let cr = dir.path().join("kubevirt-cr.yaml");
    std::fs::write(&cr, KUBEVIRT_CR)?;
    env.kubectl(&["apply", "-f", &cr.to_string_lossy()])?;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let phase = env
            .kubectl(&["get", "kubevirt", "kubevirt", "-n", NAMESPACE, "-o", "jsonpath={.status.phase}"])
            .unwrap_or_default();
        if phase.trim() == "Deployed" {
            break;
        }
        if Instant::now() > deadline {
            let pods = env.kubectl(&["get", "pods", "-n", NAMESPACE, "-o", "wide"]).unwrap_or_default();
            let kv = env
                .kubectl(&["get", "kubevirt", "kubevirt", "-n", NAMESPACE, "-o", "yaml"])
                .unwrap_or_default();
            anyhow::bail!("KubeVirt not Deployed after 600 s (phase {phase:?}):\n{pods}\n{kv}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!("vmmigrate-harness: KubeVirt {VERSION} deployed in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}
