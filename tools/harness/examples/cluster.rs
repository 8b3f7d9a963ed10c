//! Starts the tests' one-node cluster with real CDI and real KubeVirt and
//! keeps it until Enter (or end of input), for looking around with kubectl:
//!
//!   cargo run -p vmmigrate-harness --example cluster
//!
//! Prints the kubeconfig to use. Everything goes when it exits.

fn main() -> anyhow::Result<()> {
    let env = vmmigrate_harness::KubeEnv::start_owned_for_kubevirt()?;
    eprintln!("cluster up in {:.1} s", env.startup.as_secs_f64());
    env.cdi()?;
    env.kubevirt()?;
    println!("export KUBECONFIG={}", env.kubeconfig_path().display());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    Ok(())
}
