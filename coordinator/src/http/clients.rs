//! Connections per client address (`max_connections_per_client`).
//!
//! Each accepted TCP connection takes a place in its peer address's count for as long as
//! it is open ([`ConnectionSlot`], kept in the connection's data and dropped with it).
//! A connection past the limit is served nothing: each request on it gets 429
//! `too_many_connections` and the connection is closed. Slow clients that hold many
//! sockets open (a byte a second) thus cost one address a bounded number of sockets.
//! Behind a proxy every client shares the proxy's address: raise the limit there, or set
//! it to 0 (no limit).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::ConnectionType;
use actix_web::middleware::Next;
use actix_web::ResponseError;

use crate::api::error::ApiError;

/// Open connections by client address.
#[derive(Debug)]
pub struct ClientTable {
    /// Most connections of one address (0: no limit).
    limit: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in its address's count, given back when it is dropped.
#[derive(Debug)]
pub struct ConnectionSlot {
    table: Arc<ClientTable>,
    ip: IpAddr,
    /// The connection came past the limit: every request on it is refused.
    over: bool,
}

impl ClientTable {
    /// A table allowing `limit` connections an address (0: no limit).
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// Counts a new connection from `ip`.
    pub fn connect(self: &Arc<Self>, ip: IpAddr) -> ConnectionSlot {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(ip).or_default();
        *n += 1;
        ConnectionSlot {
            table: self.clone(),
            ip,
            over: self.limit > 0 && *n > self.limit,
        }
    }

    /// Connections open from `ip`.
    pub fn open(&self, ip: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(&ip).copied().unwrap_or(0)
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = self
            .table
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// The middleware: refuses every request of a connection past its address's limit.
pub async fn check<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<B>>, actix_web::Error> {
    let refused = req
        .conn_data::<ConnectionSlot>()
        .filter(|slot| slot.over)
        .map(|slot| slot.table.limit);
    match refused {
        None => next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body),
        Some(limit) => {
            let error = ApiError::TooManyConnections { limit };
            let mut response = error.error_response();
            response
                .head_mut()
                .set_connection_type(ConnectionType::Close);
            Ok(req.into_response(response).map_into_right_body())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_has_its_own_count_given_back_on_close() {
        let table = ClientTable::new(2);
        let a = IpAddr::from([10, 0, 0, 1]);
        let b = IpAddr::from([10, 0, 0, 2]);
        let first = table.connect(a);
        let second = table.connect(a);
        let third = table.connect(a);
        assert!(!first.over && !second.over && third.over);
        assert!(
            !table.connect(b).over,
            "another address is not counted with a"
        );
        assert_eq!(table.open(b), 0, "its connection closed");
        drop(third);
        drop(first);
        assert_eq!(table.open(a), 1);
        assert!(!table.connect(a).over, "a place came back");
        let unlimited = ClientTable::new(0);
        let many: Vec<_> = (0..100).map(|_| unlimited.connect(a)).collect();
        assert!(many.iter().all(|s| !s.over));
    }
}
