//! Client certificate revocation: certificate revocation lists (CRLs, PEM `X509 CRL` sections)
//! that the server's client-certificate verifier checks at every handshake, the set of revoked
//! (issuer, serial) pairs a server checks its open connections against when a list changes,
//! and `tether revoke-client-cert`'s signing of a list with the dev CA.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rustls::pki_types::CertificateRevocationListDer;
use rustls::pki_types::pem::PemObject;
use x509_parser::num_bigint::BigUint;

use crate::tls::{TlsError, dev_ca_issuer, io_err, parse_certs, read_file, write_file};

/// How long a list the dev CA signs stays current (its `nextUpdate`), in days. The verifier
/// does not enforce it: a list stays in force until it is replaced.
pub const CRL_VALIDITY_DAYS: i64 = 365;

/// Revocation lists read from a PEM file, and the (issuer, serial) pairs they revoke.
#[derive(Clone, Debug, Default)]
pub struct Crls {
    /// For the rustls verifier.
    pub ders: Vec<CertificateRevocationListDer<'static>>,
    revoked: HashSet<(Vec<u8>, Vec<u8>)>,
}

impl Crls {
    /// Reads every CRL in the PEM file `path`; each must parse (a damaged list is refused,
    /// not half applied). A file with no CRL section is an error.
    pub fn load(path: &Path) -> Result<Crls, TlsError> {
        let pem = read_file(path)?;
        let bad = |message: String| TlsError::Pem {
            path: path.to_path_buf(),
            message,
        };
        let ders = CertificateRevocationListDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(e.to_string()))?;
        if ders.is_empty() {
            return Err(bad("no X509 CRL section".into()));
        }
        let mut revoked = HashSet::new();
        for der in &ders {
            let (_, crl) = x509_parser::parse_x509_crl(der.as_ref())
                .map_err(|e| bad(format!("not a certificate revocation list: {e}")))?;
            let issuer = crl.issuer().as_raw().to_vec();
            for r in crl.iter_revoked_certificates() {
                revoked.insert((issuer.clone(), r.serial().to_bytes_be()));
            }
        }
        Ok(Crls { ders, revoked })
    }

    /// Revoked certificates listed.
    pub fn revoked_count(&self) -> usize {
        self.revoked.len()
    }

    /// Whether the certificate (DER) is revoked by these lists.
    pub fn revokes(&self, cert_der: &[u8]) -> bool {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert_der) else {
            return false;
        };
        self.revoked
            .contains(&(cert.issuer().as_raw().to_vec(), cert.serial.to_bytes_be()))
    }

    /// Whether the certificate a connection presented is revoked by these lists.
    pub fn revokes_peer(&self, conn: &quinn::Connection) -> bool {
        let Some(identity) = conn.peer_identity() else {
            return false;
        };
        identity
            .downcast_ref::<Vec<rustls::pki_types::CertificateDer<'static>>>()
            .and_then(|chain| chain.first())
            .is_some_and(|leaf| self.revokes(leaf.as_ref()))
    }
}

/// What [`revoke_dev_client_cert`] wrote.
#[derive(Clone, Debug)]
pub struct Revocation {
    /// The list written.
    pub crl: PathBuf,
    /// The revoked certificate's serial number, hex.
    pub serial: String,
    /// Certificates the list revokes now.
    pub revoked: usize,
    /// The list's CRL number (one more than the list it replaced).
    pub crl_number: u64,
}

/// Adds the client certificate in the PEM file `cert` to the revocation list `crl` (created
/// when missing), signed by the dev CA in `tls_dir`; the certificates the old list revoked stay
/// revoked and the CRL number goes up by one. The certificate must have been issued by that CA.
pub fn revoke_dev_client_cert(
    tls_dir: &Path,
    cert: &Path,
    crl: &Path,
) -> Result<Revocation, TlsError> {
    let bad = |path: &Path, message: String| TlsError::Pem {
        path: path.to_path_buf(),
        message,
    };
    let ca_cert_path = tls_dir.join(crate::tls::CA_CERT_FILE);
    let ca_cert = parse_certs(&read_file(&ca_cert_path)?, &ca_cert_path)?;
    let (_, ca) = x509_parser::parse_x509_certificate(ca_cert[0].as_ref())
        .map_err(|e| bad(&ca_cert_path, e.to_string()))?;
    let leaf_der = parse_certs(&read_file(cert)?, cert)?.swap_remove(0);
    let (_, leaf) = x509_parser::parse_x509_certificate(leaf_der.as_ref())
        .map_err(|e| bad(cert, e.to_string()))?;
    if !crate::tls::chains_to(&leaf_der, &[], crate::tls::roots_from(&ca_cert_path)?) {
        return Err(bad(
            cert,
            format!(
                "not issued by the CA in {} (or no longer valid)",
                tls_dir.display()
            ),
        ));
    }
    let now = time::OffsetDateTime::now_utc();
    let mut revoked: Vec<rcgen::RevokedCertParams> = Vec::new();
    let mut crl_number = BigUint::from(0u32);
    if crl.exists() {
        let old = Crls::load(crl)?;
        for der in &old.ders {
            let (_, list) =
                x509_parser::parse_x509_crl(der.as_ref()).map_err(|e| bad(crl, e.to_string()))?;
            if list.issuer().as_raw() != ca.subject().as_raw() {
                return Err(bad(crl, "a list from another issuer".into()));
            }
            if let Some(n) = list.crl_number() {
                crl_number = crl_number.max(n.clone());
            }
            for r in list.iter_revoked_certificates() {
                revoked.push(rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from_slice(&r.serial().to_bytes_be()),
                    revocation_time: time::OffsetDateTime::from_unix_timestamp(
                        r.revocation_date.timestamp(),
                    )
                    .unwrap_or(now),
                    reason_code: None,
                    invalidity_date: None,
                });
            }
        }
    }
    let serial = leaf.serial.to_bytes_be();
    let serial_hex: String = serial.iter().map(|b| format!("{b:02x}")).collect();
    let already = revoked
        .iter()
        .any(|r| r.serial_number.as_ref() == serial.as_slice());
    if !already {
        revoked.push(rcgen::RevokedCertParams {
            serial_number: rcgen::SerialNumber::from_slice(&serial),
            revocation_time: now,
            reason_code: Some(rcgen::RevocationReason::CessationOfOperation),
            invalidity_date: None,
        });
    }
    crl_number += 1u32;
    let number = u64::try_from(crl_number.clone()).unwrap_or(u64::MAX);
    let params = rcgen::CertificateRevocationListParams {
        this_update: now,
        next_update: now + time::Duration::days(CRL_VALIDITY_DAYS),
        crl_number: rcgen::SerialNumber::from_slice(&crl_number.to_bytes_be()),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    };
    let issuer = dev_ca_issuer(tls_dir)?;
    let list = params.signed_by(&issuer)?;
    let count = params.revoked_certs.len();
    // Written whole, then renamed: a server reloading the list never reads half of it.
    let tmp = crl.with_extension("pem.tmp");
    write_file(&tmp, list.pem()?.as_bytes(), None)?;
    std::fs::rename(&tmp, crl).map_err(io_err(crl))?;
    Ok(Revocation {
        crl: crl.to_path_buf(),
        serial: serial_hex,
        revoked: count,
        crl_number: number,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{ensure_dev_certs, issue_dev_client_cert};

    fn der(cert: &Path) -> Vec<u8> {
        parse_certs(&read_file(cert).unwrap(), cert).unwrap()[0]
            .as_ref()
            .to_vec()
    }

    #[test]
    fn revocations_accumulate_and_match_only_their_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let tls = dir.path().join("tls");
        ensure_dev_certs(&tls).unwrap();
        let out = dir.path().join("clients");
        let (a, _) = issue_dev_client_cert(&tls, "a", &out).unwrap();
        let (b, _) = issue_dev_client_cert(&tls, "b", &out).unwrap();
        let (c, _) = issue_dev_client_cert(&tls, "c", &out).unwrap();
        let crl = dir.path().join("crl.pem");
        let r = revoke_dev_client_cert(&tls, &a, &crl).unwrap();
        assert_eq!((r.revoked, r.crl_number), (1, 1));
        let r = revoke_dev_client_cert(&tls, &b, &crl).unwrap();
        assert_eq!((r.revoked, r.crl_number), (2, 2));
        // Revoking again changes nothing but the list's number.
        let r = revoke_dev_client_cert(&tls, &b, &crl).unwrap();
        assert_eq!((r.revoked, r.crl_number), (2, 3));
        let crls = Crls::load(&crl).unwrap();
        assert_eq!(crls.revoked_count(), 2);
        assert!(crls.revokes(&der(&a)) && crls.revokes(&der(&b)));
        assert!(!crls.revokes(&der(&c)));

        // A certificate of another CA is neither revocable here nor matched by serial alone.
        let other = dir.path().join("other");
        ensure_dev_certs(&other).unwrap();
        let (m, _) = issue_dev_client_cert(&other, "m", &out).unwrap();
        let e = revoke_dev_client_cert(&tls, &m, &crl)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not issued by the CA"), "{e}");
        assert!(!crls.revokes(&der(&m)));

        // Damaged or empty files are refused with their path.
        std::fs::write(&crl, "not pem").unwrap();
        let e = Crls::load(&crl).unwrap_err().to_string();
        assert!(e.contains("no X509 CRL section"), "{e}");
    }
}
