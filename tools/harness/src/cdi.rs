//! Real CDI v1.65.0 on the test node, deployed the way CDI deploys itself:
//! its operator, with the image names it is given, from the manifests CDI's
//! own `manifest-generator` writes, and a `CDI` resource; the operator then
//! installs the controller, the API server (with its DataVolume webhooks and
//! the upload API) and the upload proxy. The importer pods it starts for
//! DataVolumes are real pods on the node, writing real PersistentVolumes of
//! the node's provisioner.
//!
//! Why the operator and not the components by hand: the operator is what
//! owns CDI's RBAC, certificates, webhooks and configuration (CDIConfig,
//! StorageProfiles) upstream; deploying its Deployments ourselves would mean
//! keeping our own copy of all of that.
//!
//! Built from CDI's Go module by `tools/testenv/upstream.sh`, images by
//! `tools/testenv/cdi-images.sh` (the importer's from Debian: qemu-img and
//! nbdkit with its curl plugin, what its HTTP path calls). One stand-in: the
//! libnbd Go binding, which the module proxy here refuses; it serves only the
//! VDDK importer (vSphere through VMware's closed library), which vmmigrate
//! never asks for.

use crate::KubeEnv;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const VERSION: &str = "v1.65.0";
pub const NAMESPACE: &str = "cdi";

fn image(component: &str) -> String {
    format!("registry.test.local/{component}:{VERSION}")
}

/// Builds (once, cached), imports and deploys CDI; returns when the
/// operator reports CDI `Deployed`.
pub fn install(env: &KubeEnv) -> anyhow::Result<()> {
    let started = Instant::now();
    let upstream = crate::setup::upstream()?;
    let images = crate::setup::run_build_script(
        "testenv-cdi-images",
        "tools/testenv/cdi-images.sh",
        &[&upstream, &crate::setup::cache_root().join("testenv-cdi-images")],
    )?;
    for entry in std::fs::read_dir(&images)? {
        let path = entry?.path();
        if path.to_string_lossy().ends_with(".oci.tar") {
            env.import_image(&path)?;
        }
    }
    let generated = Command::new(upstream.join("bin/manifest-generator"))
        .args([
            "-resource-type=operator",
            "-resource-group=everything",
            &format!("-namespace={NAMESPACE}"),
            &format!("-operator-version={VERSION}"),
            "-deploy-cluster-resources=true",
            &format!("-operator-image={}", image("cdi-operator")),
            &format!("-controller-image={}", image("cdi-controller")),
            &format!("-importer-image={}", image("cdi-importer")),
            &format!("-cloner-image={}", image("cdi-cloner")),
            &format!("-apiserver-image={}", image("cdi-apiserver")),
            &format!("-uploadproxy-image={}", image("cdi-uploadproxy")),
            &format!("-uploadserver-image={}", image("cdi-uploadserver")),
            // Only for oVirt sources; any image name will do.
            &format!("-ovirt-populator-image={}", image("cdi-importer")),
            "-pull-policy=IfNotPresent",
            "-verbosity=1",
        ])
        .stderr(Stdio::inherit())
        .output()?;
    anyhow::ensure!(generated.status.success(), "manifest-generator failed");
    let dir = tempfile::tempdir()?;
    let namespace = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NAMESPACE}\n  labels:\n    cdi.kubevirt.io: \"\"\n---\n"
    );
    let operator = dir.path().join("cdi-operator.yaml");
    std::fs::write(&operator, [namespace.as_bytes(), &generated.stdout].concat())?;
    env.kubectl(&["apply", "--server-side", "--force-conflicts", "-f", &operator.to_string_lossy()])?;
    let cr = dir.path().join("cdi-cr.yaml");
    std::fs::write(
        &cr,
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: CDI\nmetadata:\n  name: cdi\nspec:\n  imagePullPolicy: IfNotPresent\n  workload: {}\n  infra: {}\n",
    )?;
    env.kubectl(&["apply", "-f", &cr.to_string_lossy()])?;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let phase = env.kubectl(&["get", "cdi", "cdi", "-o", "jsonpath={.status.phase}"]).unwrap_or_default();
        if phase.trim() == "Deployed" {
            break;
        }
        if Instant::now() > deadline {
            let pods = env.kubectl(&["get", "pods", "-n", NAMESPACE, "-o", "wide"]).unwrap_or_default();
            let cdi = env.kubectl(&["get", "cdi", "cdi", "-o", "yaml"]).unwrap_or_default();
            anyhow::bail!("CDI not Deployed after 600 s (phase {phase:?}):\n{pods}\n{cdi}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    // CDI knows which access and volume modes a class supports only for the
    // provisioners it lists; for the node's rancher.io/local-path a cluster
    // administrator says so on its StorageProfile (CDI's documented way).
    let profile =
        r#"{"spec":{"claimPropertySets":[{"accessModes":["ReadWriteOnce"],"volumeMode":"Filesystem"}]}}"#;
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Err(e) = env.kubectl(&["patch", "storageprofile", "local-path", "--type=merge", "-p", profile])
    {
        anyhow::ensure!(Instant::now() < deadline, "StorageProfile local-path: {e:#}");
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!("vmmigrate-harness: CDI {VERSION} deployed in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}
