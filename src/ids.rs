//! Identifiers shared by every layer, each defined once.
//!
//! Queue ids and stored-entry offsets are the storage crate's ([`tether_storage::QueueId`],
//! [`tether_storage::Offset`]); a replication log's offsets are one below the stored entry's
//! (`replication::Offset`, see the replication module).

use std::fmt;

use serde::{Deserialize, Serialize};

/// A member of the cluster: a stable 64-bit hash of its name (`cluster::meta::raft_id`), the
/// id the consensus group and replication know it by. A newtype, so a node id is never taken
/// for an epoch, an offset or a count. Shown in decimal (`{}`) or hex (`{:x}`, as logs and
/// errors name peers); stored and sent as the plain number.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::LowerHex for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_transport::codec::{decode_body, encode_body};

    #[test]
    fn a_node_id_is_encoded_as_its_plain_number() {
        for n in [0, 7, u64::MAX] {
            let id = encode_body(&NodeId(n)).unwrap();
            assert_eq!(id, encode_body(&n).unwrap());
            assert_eq!(
                decode_body::<NodeId>(&encode_body(&n).unwrap()).unwrap(),
                NodeId(n)
            );
        }
        assert_eq!(format!("{} {:x}", NodeId(255), NodeId(255)), "255 ff");
    }
}
