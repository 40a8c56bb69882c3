{{- define "offloadpool.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "offloadpool.labels" -}}
app.kubernetes.io/part-of: offloadpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "offloadpool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "offloadpool.agentImage" -}}
{{ .Values.agent.image | default (include "offloadpool.image" .) }}
{{- end -}}

{{- define "offloadpool.operatorServiceAccount" -}}
{{ include "offloadpool.fullname" . }}-operator
{{- end -}}

{{- define "offloadpool.webhookService" -}}
{{ include "offloadpool.fullname" . }}-webhook
{{- end -}}

{{- define "offloadpool.webhookExcludedNamespaces" -}}
{{- $system := list "kube-system" "kube-public" "kube-node-lease" -}}
{{- $all := concat $system (list .Release.Namespace) .Values.webhook.excludeNamespaces | uniq -}}
{{- toJson $all -}}
{{- end -}}

{{- /* The Secret holding the webhook's certificates, if any (else the operator makes its own). */ -}}
{{- define "offloadpool.webhookCertSecret" -}}
{{- if .Values.webhook.certSecret -}}
{{ .Values.webhook.certSecret }}
{{- else if .Values.webhook.certManager.enabled -}}
{{ include "offloadpool.fullname" . }}-webhook-tls
{{- end -}}
{{- end -}}
