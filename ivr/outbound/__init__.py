"""Outbound calls: dial (POST /calls, `ivr dial`), campaigns from CSV, answering machines."""
