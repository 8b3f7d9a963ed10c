//! The one type of every failure reason the machine, the controller and the
//! status use. The variant's name is the stable string users see as the
//! condition reason, the Event reason, the `status.errors[].reason`, the
//! metric label and the STATUS.md cell: renaming a variant is an API change.

/// Declares the reasons once: the enum, `ALL` and the stable strings.
macro_rules! reasons {
    ($($name:ident,)*) => {
        /// A stable, CamelCase failure reason.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        pub enum Reason {
            $($name,)*
        }

        impl Reason {
            /// Every reason, in declaration order.
            #[cfg(test)]
            pub(crate) const ALL: &[Reason] = &[$(Reason::$name,)*];

            /// The stable string.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$name => stringify!($name),)*
                }
            }
        }
    };
}

reasons! {
    // The machine's own decisions
    RetryBudgetExhausted,
    ValidationBlocked,
    SourceNotPoweredOff,
    SourceSuspended,
    SourcePoweredOnAgain,
    SourceDisksChanged,
    ToolsNotRunning,
    GuestShutdownTimeout,
    DestinationVMNotOwned,
    DestinationVMNotConverging,
    StartTimeout,
    ApplicationCheckFailed,
    GuestRootDiskNotFound,
    ValidationTimeout,
    InventoryMissing,
    ObservationMismatch,
    AcquiredCopyCorrupt,
    AcquiredCopyMissing,
    Timeout,
    SourceChangedSinceDiscovery,
    SourcePowerUnknown,
    OrphanNotConfirmed,
    // Pre-flight rules (Validated)
    SnapshotsPresent,
    PendingQuestion,
    UnsupportedDiskType,
    IndependentDisk,
    NoDisks,
    NetworkNotMapped,
    InvalidDestinationName,
    DestinationNameTaken,
    StorageClassNotFound,
    DestinationNamespaceNotFound,
    DestinationNamespaceNotAllowed,
    SourceVMClaimed,
    InvalidCutoverWindow,
    PassthroughDevice,
    SharedDisk,
    EncryptedVM,
    PersistentMemory,
    // What moves with a caveat (status.warnings, set at Validated)
    TpmNotMigrated,
    SriovNicNotMigrated,
    CdromImageNotMigrated,
    UsbDeviceNotMigrated,
    HotPlugNotCarried,
    AffinityNotCarried,
    NestedVirtualization,
    PortNotMigrated,
    GuestOSNotConvertible,
    WindowsWithoutVirtio,
    // Waiting before the cutover (status.waiting), in the order they are asked
    WaitingForWave,
    WaveHeld,
    WaitingForWindow,
    CutoverWindowClosed,
    WaitingForApproval,
    WaitingForHostSlot,
    WaitingForClusterSlot,
    // The ESXi host over SSH
    SSHTimeout,
    SSHConnectFailed,
    SSHAuthenticationFailed,
    SSHError,
    HostKeyMismatch,
    InvalidCredentials,
    UnsafeArgument,
    CredentialsSecretMissing,
    CredentialsSecretInvalid,
    CredentialsNotForHost,
    SourcePathRefused,
    DiskDescriptorInvalid,
    SourceVMNotFound,
    AmbiguousVMName,
    VmxUnreadable,
    UnparsableOutput,
    InvalidPowerState,
    PowerOffNotObserved,
    HostFault,
    SnapshotFailed,
    SnapshotChainUnexpected,
    PowerActionRefused,
    APIUnavailable,
    // The disk copy
    ChecksumMismatch,
    ConnectionLost,
    SourceChanged,
    SourceUnreadable,
    LocalDiskError,
    WorkDirectoryFull,
    CopyTaskPanicked,
    // Conversion and staging
    VirtualSizeMismatch,
    InvalidArtifact,
    VirtV2vNotInstalled,
    VirtioWinMissing,
    UefiFirmwareMissing,
    VirtV2vFailed,
    QemuImgFailed,
    QemuImgNotInstalled,
    ConversionIoError,
    ConversionJobFailed,
    ConversionKilled,
    ConversionPanicked,
    JobRenderError,
    JobRunnerNotConfigured,
    ArtifactMissing,
    WorkDirError,
    // Worker pods (data plane `pods`)
    WorkerFailed,
    WorkerCannotStart,
    WorkerProtocolError,
    // The Kubernetes API and the destination
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    APIError,
    DataVolumeNotOwned,
    ImportFailed,
    ImportStalled,
    ImportChecksumMismatch,
    ImportUnverifiable,
    CDIMissing,
    VolumeCheckFailed,
    NoKVM,
    Unschedulable,
    VMIFailed,
    RenderError,
    // The controller process
    FinalizerError,
    KubeAPIError,
    LostLease,
    InvalidLeaderElectionConfig,
}

impl Reason {
    /// Whether a failure for this reason is waited out without spending the
    /// retry budget: the transport's (`is_transport`), and a full work
    /// directory, which frees up when a person (or another migration's
    /// cleanup) makes room; the step resumes where it stopped.
    pub fn is_waited_out(self) -> bool {
        self.is_transport() || self == Reason::WorkDirectoryFull
    }

    /// A failure of the path to something that answered before (an API
    /// server in a brownout, a connection lost mid-copy, a call that timed
    /// out), not of the migration: it never spends the retry budget, however
    /// long it lasts. A host that cannot be reached (`is_host_reach`) spends
    /// it in discovery only.
    pub fn is_transport(self) -> bool {
        matches!(
            self,
            Reason::Timeout
                | Reason::ConnectionLost
                | Reason::APIUnavailable
                | Reason::APIError
                | Reason::Conflict
                | Reason::KubeAPIError
        )
    }

    /// A failure to reach the ESXi host over SSH (connect, handshake,
    /// session, timeout). It spends the retry budget in discovery, and is
    /// waited out in the phases after it: the host answered before, so it
    /// is a restart, a reboot or a path that went away, not a wrong name.
    pub fn is_host_reach(self) -> bool {
        matches!(self, Reason::SSHConnectFailed | Reason::SSHTimeout | Reason::SSHError)
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Reason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

// Status fields hold the stable string; comparing them with a reason reads
// naturally in tests and in the controller alike.
impl PartialEq<Reason> for String {
    fn eq(&self, other: &Reason) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Reason> for &str {
    fn eq(&self, other: &Reason) -> bool {
        *self == other.as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::Reason;

    #[test]
    fn every_reason_is_camel_case_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for &reason in Reason::ALL {
            let text = reason.as_str();
            assert!(text.starts_with(|c: char| c.is_ascii_uppercase()), "{text}");
            assert!(text.chars().all(|c| c.is_ascii_alphanumeric()), "{text}");
            assert!(seen.insert(text), "{text} twice");
        }
    }
}
